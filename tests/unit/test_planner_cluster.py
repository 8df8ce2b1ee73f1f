"""Cluster profiles (built-in and TOML), node-crossing, and the memory picture."""
from __future__ import annotations

import dataclasses
import os
import xml.etree.ElementTree as ET

import pytest

from composer.planner.cluster import (
    CLUSTERS,
    CPU_CORES_FALLBACK,
    CPU_MEMORY_GIB_FALLBACK,
    Cluster,
    link_gbps_latency,
    load_cluster,
    machine_cores,
    machine_memory_gib,
    spans_nodes,
)
from composer.planner.picture import memory_svg, ticks

SVG = "{http://www.w3.org/2000/svg}"


def test_builtins_load_with_positive_fields():
    assert set(CLUSTERS) == {"cpu", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200"}
    for name in CLUSTERS:
        cluster = load_cluster(name)
        assert cluster.name == name
        assert cluster.devices_per_node == 8
        assert 0 < cluster.reserved_gib < cluster.memory_gib
        assert cluster.peak_tflops and all(v > 0 for v in cluster.peak_tflops.values())
        assert 0 < cluster.matmul_efficiency <= 1 and 0 < cluster.comm_efficiency <= 1
        for f in ("intra_node_gbps", "inter_node_gbps", "intra_node_latency_us",
                  "inter_node_latency_us", "op_overhead_us"):
            assert getattr(cluster, f) > 0, (name, f)
    assert CLUSTERS["h100-80gb"].peak_tflops["bfloat16"] == 989.0
    assert "float8" not in CLUSTERS["a100-80gb"].peak_tflops


def _toml(cluster: Cluster, drop: str = "", **changes) -> str:
    """The TOML of a profile's fields (name left out: it comes from the file's stem)."""
    values = {**dataclasses.asdict(cluster), **changes}
    lines = [f"{k} = {_value(v)}" for k, v in values.items()
             if k not in ("name", "peak_tflops", drop)]
    if drop != "peak_tflops":
        lines += ["[peak_tflops]", *(f"{k} = {v}" for k, v in values["peak_tflops"].items())]
    return "\n".join(lines) + "\n"


def _value(v) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def test_toml_round_trips(tmp_path):
    path = tmp_path / "my-h100.toml"
    path.write_text(_toml(CLUSTERS["h100-80gb"]))
    assert load_cluster(str(path)) == dataclasses.replace(CLUSTERS["h100-80gb"], name="my-h100")
    path.write_text('name = "lab"\n' + _toml(CLUSTERS["cpu"]))
    assert load_cluster(str(path)) == dataclasses.replace(CLUSTERS["cpu"], name="lab")


def test_a_toml_without_the_matmul_curve_keeps_one_efficiency(tmp_path):
    """Files written before the roofline's curve load: every matmul at matmul_efficiency."""
    path = tmp_path / "old.toml"
    path.write_text(_toml(CLUSTERS["h100-80gb"], drop="matmul_half_dim")
                    .replace("matmul_half_gflop = 2.2\n", ""))
    cluster = load_cluster(str(path))
    assert (cluster.matmul_half_dim, cluster.matmul_half_gflop) == (0.0, 0.0)


@pytest.mark.parametrize("text_or_change, message", [
    ({"drop": "inter_node_gbps"}, r"bad\.toml: missing field 'inter_node_gbps'"),
    ({"memory_gbi": 80.0}, r"unknown field 'memory_gbi' \(did you mean 'memory_gib'\?\)"),
    ({"devices_per_node": 8.5}, r"devices_per_node = 8\.5: must be a positive integer"),
    ({"memory_gib": "80"}, r"memory_gib = '80': must be a positive number"),
    ({"comm_efficiency": 1.5}, r"comm_efficiency = 1\.5: must be a number in \(0, 1\]"),
    ({"intra_node_gbps": 0}, r"intra_node_gbps = 0: must be a positive number"),
    ({"matmul_efficiency": True}, r"matmul_efficiency = True"),
    ({"matmul_half_dim": -1.0}, r"matmul_half_dim = -1\.0: must be a number >= 0"),
    ({"matmul_half_gflop": "2"}, r"matmul_half_gflop = '2': must be a number >= 0"),
    ({"peak_tflops": {"bf16": 989}}, r"peak_tflops\.bf16: unknown compute dtype"),
    ("memory_gib = [", r"bad\.toml: invalid TOML"),
])
def test_bad_toml_names_the_field(tmp_path, text_or_change, message):
    path = tmp_path / "bad.toml"
    if isinstance(text_or_change, str):
        path.write_text(text_or_change)
    else:
        path.write_text(_toml(CLUSTERS["h100-80gb"], **text_or_change))
    with pytest.raises(ValueError, match=message) as error:
        load_cluster(str(path))
    assert "\n" not in str(error.value)


def test_unknown_name_lists_the_builtins(tmp_path):
    with pytest.raises(ValueError, match=r"unknown cluster 'h100' \(did you mean 'h100-80gb'\?\); "
                                         r"built-in: cpu, a100-40gb, .*b200"):
        load_cluster("h100")
    with pytest.raises(ValueError, match="no such file"):
        load_cluster(str(tmp_path / "missing.toml"))


def test_spans_nodes():
    assert not spans_nodes(range(8), 8)  # tp 8 in one node
    assert spans_nodes({0, 8}, 8)  # dp 2 over tp 8
    assert not spans_nodes({0}, 8)  # a group of one
    assert not spans_nodes({0, 2, 4, 6}, 8)  # dp 4 over tp 2
    assert spans_nodes({6, 7, 8}, 8)  # ranks 6, 7, 8 straddle


def test_link_gbps_latency():
    h100 = CLUSTERS["h100-80gb"]
    assert link_gbps_latency(h100, crosses=False) == pytest.approx((450e9 * 0.7, 5e-6))
    assert link_gbps_latency(h100, crosses=True) == pytest.approx((50e9 * 0.7, 10e-6))


def test_memory_svg_bars_segments_capacity_and_escaping():
    rows = [("fsdp 8", {"params": 2.0, "grads": 2.0, "optimizer": 8.0, "activations": 30.0}),
            ("tp <&> 8", {"params": 16.0, "grads": 16.0, "optimizer": 64.0, "activations": 5.0,
                          "other": 1.0})]
    text = memory_svg(rows, capacity_gib=79.6, title="llama3 8B & friends")
    root = ET.fromstring(text)  # parses: labels and title are escaped
    bars = root.findall(f"{SVG}g[@class='bar']")
    assert len(bars) == 2
    assert [len(bar.findall(f"{SVG}rect")) for bar in bars] == [4, 5]  # zero segment: none
    assert [t.text for t in bars[1].findall(f"{SVG}text")] == ["tp <&> 8", "102.00 GiB"]
    legend = root.find(f"{SVG}g[@class='legend']")
    assert [t.text for t in legend.findall(f"{SVG}text")] == [
        "params", "grads", "optimizer", "activations", "other"]
    assert "device memory 79.6 GiB" in text and "tp &lt;&amp;&gt; 8" in text
    # the bar over capacity ends past the dashed line, inside the picture
    line = root.find(f"{SVG}g[@class='capacity']/{SVG}line")
    last = bars[1].findall(f"{SVG}rect")[-1]
    end = float(last.get("x")) + float(last.get("width"))
    assert float(line.get("x1")) < end < float(root.get("width"))


def test_memory_svg_rejects_unknown_category():
    with pytest.raises(ValueError, match="unknown memory category 'param'"):
        memory_svg([("a", {"param": 1.0})], capacity_gib=80)


def test_the_cpu_profile_is_this_machine(tmp_path, monkeypatch):
    cpu = CLUSTERS["cpu"]
    assert cpu.cores_per_node == len(os.sched_getaffinity(0))
    kib = next(int(line.split()[1]) for line in open("/proc/meminfo")
               if line.startswith("MemTotal:"))
    assert cpu.memory_gib == pytest.approx(kib / 2**20)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  1024 kB\nMemTotal:  8388608 kB\n")
    assert machine_memory_gib(str(meminfo)) == 8.0
    meminfo.write_text("MemTotal: lots\n")
    assert machine_memory_gib(str(meminfo)) == CPU_MEMORY_GIB_FALLBACK
    assert machine_memory_gib(str(tmp_path / "none")) == CPU_MEMORY_GIB_FALLBACK == 24.0
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS: the machine's count
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert machine_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert machine_cores() == CPU_CORES_FALLBACK == 2


def test_ticks_are_round_steps_from_zero_to_the_span():
    assert ticks(84.0) == [0, 20, 40, 60, 80]
    assert ticks(2.5) == [0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert ticks(0.013) == [0, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012]
    for span in (0.3, 1.0, 7.7, 79.6, 141.0, 3e4):
        assert 4 <= len(ticks(span)) <= 9 and ticks(span)[-1] <= span
    assert ticks(1000.0) == [0, 200, 400, 600, 800, 1000]


def test_memory_svg_has_an_x_axis_in_gib_and_each_rows_step_time():
    rows = [("fsdp 8", {"params": 2.0, "optimizer": 8.0, "activations": 30.0}),
            ("tp 8", {"params": 16.0, "optimizer": 64.0, "activations": 5.0})]
    root = ET.fromstring(memory_svg(rows, capacity_gib=79.6, title="t", step_s=[1.25, 12.5]))
    axis = root.find(f"{SVG}g[@class='axis']")
    values = [float(t.text) for t in axis.findall(f"{SVG}text[@class='tick-label']")]
    xs = [float(line.get("x1")) for line in axis.findall(f"{SVG}line[@class='tick']")]
    assert values[0] == 0 and len(values) >= 4 and values == sorted(set(values))
    assert len(xs) == len(values) and xs == sorted(set(xs))
    assert values[-1] <= 85 * 1.05 < values[-1] + (values[1] - values[0])  # reaches the end
    # the ticks' scale is the bars': the 85 GiB bar ends where 85 would be on the axis
    bar = root.findall(f"{SVG}g[@class='bar']")[1].findall(f"{SVG}rect")
    end = float(bar[-1].get("x")) + float(bar[-1].get("width"))
    per_gib = (xs[-1] - xs[0]) / values[-1]
    assert end == pytest.approx(xs[0] + 85 * per_gib, abs=0.02)
    assert axis.find(f"{SVG}text[@class='axis-label']").text == "memory per rank (GiB)"
    totals = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "total"]
    assert totals == ["40.00 GiB, step 1.25 s", "85.00 GiB, step 12.5 s"]
    with pytest.raises(ValueError, match="step_s has 1 times for 2 rows"):
        memory_svg(rows, capacity_gib=80, step_s=[1.0])

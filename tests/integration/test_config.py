"""Config: defaults <- TOML <- command line, and one clear line for every kind of bad input."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from composer.config import ConfigError, JobConfig, parse_args, to_toml
from composer.mesh import ParallelDims
from composer.models import MODELS
from composer.testing.harness import ROOT, launch


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nlocal_batch_size = 3\n[optimizer]\nlr = 0.5\n")
    cfg, show = parse_args(["--config", path, "--training.steps", "9", "--optimizer.lr=0.25"])
    assert not show
    assert cfg.training.steps == 9            # override beats TOML
    assert cfg.training.local_batch_size == 3  # TOML beats default
    assert cfg.optimizer.lr == 0.25
    assert cfg.data.seq_len == JobConfig().data.seq_len  # untouched default


def test_booleans_lists_and_bare_flags():
    cfg, _ = parse_args(["--metrics.enable_tensorboard", "false", "--validation.enable",
                         "--model.converters", ""])
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.validation.enable is True
    assert cfg.model.converters == []


def test_print_config_round_trips(tmp_path):
    cfg, _ = parse_args(["--training.steps", "11", "--data.dataset", 'a "quoted" name'])
    again, _ = parse_args(["--config", write(tmp_path, to_toml(cfg))])
    assert again == cfg


BAD = [
    (["--trainig.steps", "3"], "unknown section 'trainig' (did you mean 'training'?)"),
    (["--training.step", "3"], "unknown key 'training.step' (did you mean 'training.steps'?)"),
    (["--training.steps", "three"], "training.steps='three': expected int"),
    (["--training.steps", "0"], "training.steps=0: out of range"),
    (["--training.dtype", "float16"],
     "training.dtype='float16': not allowed; choose one of: float32, bfloat16, float64"),
    (["--parallelism.zero_stage", "4"], "parallelism.zero_stage=4: not allowed"),
    (["--metrics.enable_tensorboard", "maybe"],
     "metrics.enable_tensorboard='maybe': expected bool"),
    (["--training.global_batch_size", "-2"],
     "training.global_batch_size=-2: out of range; allowed: [1, inf] or -1"),
    (["--steps", "3"], "'steps': keys are written section.key"),
    (["--config", "/no/such.toml"], "--config /no/such.toml: no such file"),
    (["--checkpoint.on_save_error", "retry"],
     "checkpoint.on_save_error='retry': not allowed; choose one of: stop, continue"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_invalid_toml_names_the_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 3\nlr = = 2\n")
    with pytest.raises(ConfigError, match="invalid TOML.*line 3"):
        parse_args(["--config", path])


def test_wrong_type_in_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"training.steps='10': expected int"):
        parse_args(["--config", write(tmp_path, '[training]\nsteps = "10"\n')])


CLI_BAD = [
    (["--training.stepz", "3"], "training.stepz"),
    (["--model.flavor", "9B"], "model.flavor='9B': unknown for llama3; allowed: debug"),
    (["--model.name", "gpt"], "model.name='gpt'"),
    (["--data.seq_len", "100000"], "data.seq_len=100000"),
    (["--data.dataset", "/no/such/corpus.txt"], "data.dataset='/no/such/corpus.txt'"),
    (["--data.tokenizer", "sentencepiece"],  # the key once: the library's message names no key
     "data.tokenizer='sentencepiece': tokenizer 'sentencepiece' is neither 'byte' nor the path"),
    (["--training.global_batch_size", "12"],
     "training.global_batch_size=12: must be a multiple of"),
    (["--parallelism.context_parallel_degree", "0"], "parallelism.context_parallel_degree=0"),
    (["--parallelism.context_parallel_method", "ring"],
     "parallelism.context_parallel_method='ring'"),
    (["--data.document_mask", "sometimes"],
     "data.document_mask='sometimes': not allowed; choose one of: auto, true, false"),
    (["--data.reset_positions", "2"], "data.reset_positions='2': expected bool"),
    (["--job.device", "tpu"], "job.device='tpu'"),
    (["--activation_checkpoint.mode", "partial"], "activation_checkpoint.mode='partial'"),
    (["--activation_checkpoint.every", "0"], "activation_checkpoint.every=0"),
    (["--compile.backend", "tvm"], "compile.backend='tvm'"),
    (["--model.converters", "int4"],
     "model.converters: unknown entry 'int4'; allowed: float8, lora, qlora"),
    (["--model.converters", "lora", "--lora.target_modules", "q_proj"],
     "lora.target_modules=['q_proj']: 'q_proj' is no linear of llama3/debug; allowed: output, w1"),
    (["--model.name", "qwen3", "--model.converters", "lora", "--lora.target_modules", "wq,output"],
     "lora.target_modules: 'output' shares its weight with another module in debug; its merged "
     "weight could not stay tied"),
    (["--job.plugins", "tests.support.plugin", "--model.name", "made",
      "--model.converters", "lora"],
     "lora.target_modules=[]: model 'made' names no default targets "
     "(ModelSpec.adapters.lora_targets); choose from: block, output"),
    (["--model.converters", "lora", "--lora.rank", "0"], "lora.rank=0: out of range"),
    (["--model.converters", "lora", "--checkpoint.last_save_in_hf"],
     "set lora.merge_on_export=true"),
    (["--data.format", "chat"],
     "data.format='chat': not allowed; choose one of: text, sft, preference"),
    (["--data.format", "sft"], "data.dataset='tinyshakespeare'"),
    (["--model.converters", "float8", "--training.dtype", "float64"],
     "float8 casts from float32 or bfloat16"),
    (["--model.converters", "float8", "--float8.recipe", "rowwise",
      "--float8.fsdp_float8_all_gather", "true"], "float8 all-gather needs recipe 'tensorwise'"),
    (["--metrics.memory_breakdown", "--compile.enable"],
     "metrics.memory_breakdown=true with compile.enable=true on CPU"),
    (["--metrics.memory_breakdown", "--parallelism.pipeline_parallel_degree", "2"],
     "metrics.memory_breakdown=true with parallelism.pipeline_parallel_degree=2 on CPU"),
    (["--metrics.memory_breakdown", "--training.global_batch_size", "16"],
     "metrics.memory_breakdown=true with 2 accumulation steps on CPU"),
    (["--profiling.enable", "--training.steps", "3", "--profiling.start_step", "3"],
     "profiling.start_step=3 with profiling.steps=2: the window ends at step 4, past "
     "training.steps=3; allowed: start_step + steps - 1 <= 3"),
    (["--profiling.steps", "0"], "profiling.steps=0"),
    (["--model.converters", "float8", "--float8.emulate", "false"],
     "float8.emulate='false' on CPU"),
]


def run_main(monkeypatch, capsys, world_size: int, argv: list[str]) -> tuple[int, list[str]]:
    """composer.cli.run_argv in this process (no process group is ever made on
    bad input, so it needs none): exit code and stderr lines."""
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    code = run_argv(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv,message", CLI_BAD)
def test_command_line_errors_exit_2_with_one_line(monkeypatch, capsys, tmp_path, argv, message):
    out = tmp_path / "out"
    code, lines = run_main(monkeypatch, capsys, 1, ["--training.local_batch_size", "8",
                                                    "--job.dump_folder", str(out), *argv])
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0]
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("argv", [["--training.stepz", "3"], ["--data.dataset", "/no/such.txt"]])
def test_a_real_process_exits_2_without_traceback(tmp_path, argv):
    result = launch(["--job.dump_folder", str(tmp_path / "out"), *argv], timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stdout + result.stderr


def test_world_size_mismatch_names_the_degrees():
    # the library raises a plain ValueError; plan_job turns it into the CLI's ConfigError
    with pytest.raises(ValueError, match="multiply to 8 but the world size is 4: "
                                         "pp 1 x dp_replicate 2 x dp_shard 4") as e:
        ParallelDims(dp_replicate=2, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=4)
    assert not isinstance(e.value, ConfigError)
    with pytest.raises(ValueError, match="world size 6 is not divisible by .* dp_replicate 4"):
        ParallelDims(dp_replicate=4, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=6)
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=8)
    assert dims.dp_shard == 4 and dims.dp == 8
    assert [dims.dp_rank(r) for r in range(8)] == list(range(8))


def test_dp_rank_skips_inner_dims():
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=2, ep=1, world_size=8)
    # ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_the_128k_context_config_validates_for_its_32_ranks(monkeypatch, capsys):
    """Llama 3.1 8B at seq 131072: max_seq_len raised by an override, tp 8 x cp 4."""
    config = ["--config", "train_configs/llama3_8b_128k.toml", "--validate"]
    assert run_main(monkeypatch, capsys, 32, config) == (0, [])
    code, lines = run_main(monkeypatch, capsys, 16, config)
    assert code == 2 and lines == ["error: world size 16 is not divisible by pp 1 x dp_replicate "
                                   "1 x cp 4 x tp 8 = 32, so "
                                   "parallelism.data_parallel_shard_degree=-1 has no whole value "
                                   "(16 / 32 = 0.50)"]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_shipped_configs_parse(name):
    cfg, _ = parse_args(["--config", str(ROOT / "train_configs" / name)])
    # a Hugging Face folder gives the sizes (model.hf_path); a flavor otherwise
    assert cfg.model.hf_path or cfg.model.flavor in MODELS[cfg.model.name].flavors


def validate(world_size: int, *args: str, per_node: int = 8) -> subprocess.CompletedProcess:
    """``--validate`` checks a job as a world of that size would see it, no processes started."""
    cmd = [sys.executable, "-m", "composer.train", "--config", "train_configs/debug_model.toml",
           "--validate", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(per_node),
                               "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


TP = "--parallelism.tensor_parallel_degree"
PP = "--parallelism.pipeline_parallel_degree"
EP = "--parallelism.expert_parallel_degree"
MOE = "--model.name", "moe"
CP = "--parallelism.context_parallel_degree"
WORLD_BAD = [
    (4, [*MOE, CP, "2", EP, "8"],
     "parallelism.expert_parallel_degree=8 must divide dp_shard x cp = 2 x 2 = 4"),
    (1, ["--data.reset_positions", "true", "--data.document_mask", "false"],
     "data.reset_positions=true: positions restart at document boundaries, which need "
     "data.document_mask=true"),
    (1, ["--data.streaming", "true", "--data.format", "sft"],
     "data.streaming=true: only data.format='text' streams; 'sft' examples are held in memory"),
    (8, [CP, "4", TP, "2", "--parallelism.context_parallel_method", "alltoall"],
     "with parallelism.context_parallel_method='alltoall': the model's n_kv_heads=4 must divide "
     "by tp x cp = 8"),
    (2, [CP, "2", "--data.seq_len", "30"],
     "parallelism.context_parallel_degree=2: data.seq_len=30 must divide into 2 x cp = 4 chunks"),
    (8, [CP, "2", TP, "4", "--data.seq_len", "36"],
     "a rank's 18 positions (data.seq_len / cp) must divide by "
     "parallelism.tensor_parallel_degree=4"),
    (2, [EP, "2"],
     "parallelism.expert_parallel_degree=2: model 'llama3' has no experts; allowed: 1"),
    (6, [*MOE, EP, "3"],
     "parallelism.expert_parallel_degree=3 does not divide the model's n_experts=8 (moe/debug)"),
    (2, [*MOE, EP, "4"],
     "parallelism.expert_parallel_degree=4 must divide dp_shard x cp = 2 x 1 = 2"),
    (4, [*MOE, EP, "2", TP, "2", "--parallelism.data_parallel_shard_degree", "2",
         "--parallelism.data_parallel_replicate_degree", "1", "--parallelism.zero_stage", "0"],
     "parallelism.expert_parallel_degree=2: parallelism.zero_stage=0; expert parallel needs "
     "FSDP, allowed: zero_stage 2, 3"),
    (1, [*MOE, "--model.overrides", "top_k=9"],
     "model.overrides='top_k=9': top_k=9 must be between 1 and n_experts=8"),
    (1, [*MOE, "--model.overrides", "experts=4"],
     "model.overrides='experts=4': 'experts=4' is not key=value with a key of the flavor; "
     "allowed keys: dim, n_layers"),
    (4, ["--parallelism.data_parallel_replicate_degree", "3"], "world size 4 is not divisible"),
    (3, [TP, "3"], "parallelism.tensor_parallel_degree=3 does not divide the model's n_heads=8"),
    (8, [TP, "8"], "parallelism.tensor_parallel_degree=8 does not divide the model's n_kv_heads=4"),
    (2, [TP, "2", "--data.seq_len", "33"],
     "parallelism.tensor_parallel_degree=2 does not divide data.seq_len=33"),
    (4, [TP, "2", "--parallelism.zero_stage", "1"],
     "parallelism.zero_stage=1 shards plain tensors only"),
    (4, [TP, "2", "--parallelism.data_parallel_shard_degree", "4"],
     "parallel degrees multiply to 8 but the world size is 4"),
    (2, [PP, "2", "--parallelism.pipeline_parallel_stages_per_rank", "4",
         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "parallelism.pipeline_parallel_degree: 4 blocks cannot fill 8 stages"),
    (4, [PP, "4", "--parallelism.pipeline_parallel_first_stage_less_layers", "2"],
     "parallelism.pipeline_parallel_degree: 4 blocks cannot fill 4 stages (fewer by 2 first, "
     "0 last): sizes [0, 2, 1, 1]"),
    (2, [PP, "2", "--parallelism.pipeline_parallel_microbatches", "3"],
     "parallelism.pipeline_parallel_microbatches=3 does not divide training.local_batch_size=8"),
    (2, [PP, "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
         "--parallelism.pipeline_parallel_microbatches", "2"],
     "DualPipeV needs at least as many microbatches as stages (4)"),
    (8, [PP, "8", "--parallelism.pipeline_parallel_microbatches", "4",
         "--parallelism.pipeline_parallel_stages_per_rank", "1",
         "--parallelism.pipeline_parallel_schedule", "LoopedBFS"],
     "parallelism.pipeline_parallel_degree: 4 blocks cannot fill 8 stages"),
    (2, [PP, "2", "--training.local_batch_size", "3"],
     "training.local_batch_size=3: no multiple of the 2 pipeline stages divides it"),
    (2, [PP, "2", "--parallelism.zero_stage", "1"],
     "zero_stage=1 is not supported with pipeline parallel"),
    (2, [PP, "2", "--model.flavor", "1B", "--data.seq_len", "64"],
     "tied parameters tok_embeddings.weight, output.weight would land on stages [0, 1]"),
    (2, [PP, "2", "--parallelism.pipeline_parallel_stage_fqns", "tok_embeddings,layers.0;layers.2"],
     "parallelism.pipeline_parallel_stage_fqns: stages must list every unit once, in order"),
]


@pytest.mark.parametrize("world,args,message", WORLD_BAD)
def test_layout_errors_exit_2_before_any_process_group(monkeypatch, capsys, world, args, message):
    code, lines = run_main(monkeypatch, capsys, world,
                           ["--config", "train_configs/debug_model.toml", "--validate", *args])
    assert (code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and message in lines[0]), lines


def test_valid_tp_layout_passes_validation():
    result = validate(8, TP, "2", "--parallelism.data_parallel_replicate_degree", "2")
    assert result.returncode == 0, result.stderr
    assert "config ok for 8 rank(s)" in result.stdout


def test_tp_across_nodes_warns():
    result = validate(4, TP, "4", per_node=2)
    assert result.returncode == 0, result.stderr
    assert "tensor parallel x4 spans nodes (2 ranks per node)" in result.stdout


def test_tp_divisibility_names_every_split_size():
    import dataclasses

    from composer.models.llama import flavors, spec
    from composer.parallel.tensor import check_tp

    def check_tensor_parallel(args):  # the TP pass's own check, as the library raises it
        check_tp(4, spec, args, "llama3/debug", seq_len=256, sequence_parallel=True, zero_stage=3)

    check_tensor_parallel(flavors["debug"])  # debug divides by 4
    cases = [({"vocab_size": 510}, "vocab_size=510"), ({"n_kv_heads": 2}, "n_kv_heads=2"),
             ({"n_heads": 6, "n_kv_heads": 6, "dim": 96}, "n_heads=6"),
             ({"multiple_of": 2, "dim": 112}, "ffn_hidden_dim=298")]
    for overrides, named in cases:
        args = dataclasses.replace(flavors["debug"], **overrides)
        with pytest.raises(ValueError,
                           match=f"tensor_parallel_degree=4 does not divide the model's {named}"):
            check_tensor_parallel(args)


@pytest.mark.slow
def test_the_wheel_installs_models_as_composer_models_only(tmp_path):
    """Packaging: no top-level ``models`` module (it would clash with any other
    project's), and a distribution name of our own."""
    import shutil
    import zipfile
    source = tmp_path / "source"  # a copy: no earlier build/ can leak into the wheel
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "outputs", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True, timeout=300)
    wheel, = tmp_path.glob("*.whl")
    assert wheel.name.startswith("composer_parallel-")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"composer"}
    sources = {f"composer/{f.relative_to(ROOT / 'composer').as_posix()}"
               for f in (ROOT / "composer").rglob("*.py")}
    sources |= {f"composer/models/{f.relative_to(ROOT / 'models').as_posix()}"
                for f in (ROOT / "models").rglob("*.py")}
    assert "composer/models/llama/__init__.py" in sources
    missing = sources - set(names)  # a subpackage left out of pyproject's list
    assert not missing, sorted(missing)
    assert "composer/data/assets/tinyshakespeare.txt" in names


@pytest.mark.parametrize("argv", [[], ["--model.converters", "lora",
                                       "--parallelism.pipeline_parallel_degree", "2",
                                       "--training.local_batch_size", "8"]])
def test_planning_builds_one_meta_model_and_tokenises_nothing(monkeypatch, argv):
    """plan_job decides: the data is checked by its columns, not read through the
    tokenizer, and every check reads the same meta model."""
    import dataclasses

    from composer.data.tokenizer import ByteTokenizer
    from composer.job.plan import plan_job
    from composer.models import MODELS

    def refuse(self, text):
        raise AssertionError("planning tokenised data")
    builds = []
    spec = MODELS["llama3"]
    counting = dataclasses.replace(spec, build=lambda args: builds.append(1) or spec.build(args))
    monkeypatch.setitem(MODELS, "llama3", counting)
    monkeypatch.setattr(ByteTokenizer, "encode", refuse)
    cfg, _ = parse_args(argv)
    plan = plan_job(cfg, 0, 2 if "--parallelism.pipeline_parallel_degree" in argv else 1)
    assert len(builds) == 1 and plan.spec is counting


def test_a_model_without_a_mask_module_takes_no_documents(monkeypatch, capsys):
    """A spec that names no ``attention_mask`` takes no documents: the default
    ("auto") turns the document mask off and says so in the log; asking for it is
    one line naming the key; a model with a mask module gets it by default."""
    import dataclasses

    from composer.job.plan import resolve_model
    from composer.models import MODELS
    llama3 = MODELS["llama3"]
    monkeypatch.setitem(MODELS, "plain", dataclasses.replace(
        llama3, name="plain", parallel=dataclasses.replace(llama3.parallel, attention_mask=None)))
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert run_argv(["--model.name", "plain", "--validate"]) == 0
    assert ("data.document_mask=auto: off, model 'plain' takes no document boundaries"
            in capsys.readouterr().out)  # the log
    code, lines = run_main(monkeypatch, capsys, 1, ["--model.name", "plain", "--validate",
                                                    "--data.document_mask", "true"])
    assert code == 2 and lines == ["error: data.document_mask=true: model 'plain' takes no "
                                   "document boundaries (ModelSpec.parallel.attention_mask); "
                                   "allowed: false"]
    for name, mask in (("plain", False), ("llama3", True)):
        cfg, _ = parse_args(["--model.name", name])
        assert cfg.data.document_mask == "auto"
        run_argv(["--model.name", name, "--validate"])  # the log's stream: this test's
        resolve_model(cfg)
        assert cfg.data.document_mask is mask


def test_a_registered_section_is_set_checked_and_printed_like_a_built_in_one():
    from composer.config import SECTIONS, bounded, register_section

    @dataclasses.dataclass
    class Probe:
        depth: int = bounded(2, 1)

    try:
        register_section("probe", Probe)
        register_section("probe", Probe)  # the same class again: no-op
        cfg, _ = parse_args(["--probe.depth", "5"])
        assert cfg.probe.depth == 5 and JobConfig().probe.depth == 2
        assert "[probe]\ndepth = 5\n" in to_toml(cfg)
        with pytest.raises(ConfigError,
                           match=r"^probe.depth=0: out of range; allowed: \[1, inf\]$"):
            parse_args(["--probe.depth", "0"])
        with pytest.raises(ConfigError, match=r"did you mean 'probe.depth'"):
            parse_args(["--probe.dpeth", "3"])
        other = dataclasses.make_dataclass("Other", [("x", int, 0)])
        for name in ("probe", "training"):
            with pytest.raises(ValueError, match=f"config section '{name}' is taken"):
                register_section(name, other)
    finally:
        SECTIONS.pop("probe", None)
    with pytest.raises(ConfigError, match="unknown section 'probe'"):
        parse_args(["--probe.depth", "5"])


def test_a_model_of_ones_own_is_named_module_colon_attribute(monkeypatch, capsys):
    """model.name = "module:attribute" imports the module before the other keys
    are read and resolves to the ModelSpec it names, or that a function returns; an
    empty flavor is the spec's first. What is no spec, a module that fails while it
    is imported and a typo in a registered name are each one line."""
    from composer.job.plan import resolve_model
    cfg, _ = parse_args(["--model.name", "examples.my_model:spec"])
    spec, args = resolve_model(cfg)
    assert spec is sys.modules["examples.my_model"].spec and args == spec.flavors["tiny"]
    assert cfg.model.flavor == "tiny" and cfg.data.document_mask is True
    cfg, _ = parse_args(["--model.name", "tests.support.plugin:made_spec",
                         "--data.document_mask", "false"])
    spec, args = resolve_model(cfg)
    assert spec.name == "made" and args == {"dim": 16}
    cases = {
        "examples.my_model:TP_PLAN": "examples.my_model.TP_PLAN is a dict, not a ModelSpec (nor "
                                     "a function returning one)",
        "examples.my_model:MyArgs": "examples.my_model.MyArgs is a type, not a ModelSpec (nor a "
                                    "function returning one)",
        "examples.my_model:nothing": "module 'examples.my_model' has no attribute 'nothing'",
        "tests.support.plugin:not_a_spec":
            "tests.support.plugin.not_a_spec() returned a int, not a ModelSpec",
    }
    for name, why in cases.items():
        code, lines = run_main(monkeypatch, capsys, 1, ["--model.name", name, "--validate"])
        assert code == 2 and lines == [f"error: model.name={name!r}: {why}"]
    code, lines = run_main(monkeypatch, capsys, 1, ["--model.name", "no_such_module:spec"])
    assert code == 2 and lines == ["error: model.name: cannot import 'no_such_module' (No module "
                                   "named 'no_such_module'); allowed: a module on the Python path"]
    code, lines = run_main(monkeypatch, capsys, 1,
                           ["--model.name", "tests.support.broken_model:spec"])
    assert code == 2 and lines == ["error: model.name: importing 'tests.support.broken_model' "
                                   "failed: ZeroDivisionError: division by zero"]
    code, lines = run_main(monkeypatch, capsys, 1, ["--model.name", "lama3", "--validate"])
    assert code == 2 and lines[0].startswith("error: model.name='lama3': unknown model 'lama3' "
                                             "(did you mean 'llama3'?); registered: ")


def test_register_model_makes_a_name_trainable(monkeypatch, capsys):
    """composer.register_model from a module job.plugins imports: the spec's name
    is then a model.name like a built-in family's, listed among the registered."""
    from composer.models import MODELS
    monkeypatch.delitem(MODELS, "made", raising=False)
    # imported anew: registers
    monkeypatch.delitem(sys.modules, "tests.support.plugin", raising=False)
    code, lines = run_main(monkeypatch, capsys, 1, ["--job.plugins", "tests.support.plugin",
                                                    "--model.name", "made", "--validate"])
    assert code == 0, lines
    assert MODELS["made"].name == "made"

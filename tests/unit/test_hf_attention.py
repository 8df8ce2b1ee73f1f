"""composer's attention function inside transformers' models (``models/hf/attention.py``),
proven against transformers itself on the tiny random folders it writes
(tests/support/hf_folders.py): packed documents, with positions restarting per document
(transformers then builds its packed-sequence mask) or not (transformers given the
equivalent 4D mask); sliding windows; Gemma2's soft-capping, scaled embeddings and tied
head; gpt-oss's attention sinks; and what is refused, at validation, in one line. The
first step's loss is compared (float64, relative 1e-9): it is computed before any
weight moves, from the folder's weights."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from composer.data import DataLoader, build_tokenizer
from composer.data.loader import document_positions
from composer.testing.harness import train
from tests.support.hf_folders import make

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 64, 4
STEP = ["--model.name", "hf", "--training.dtype", "float64", "--data.seq_len", str(SEQ),
        "--training.local_batch_size", str(BATCH), "--training.steps", "1",
        "--metrics.log_freq", "1", "--validation.enable", "false",
        "--metrics.enable_tensorboard", "false"]
RESET = ["--data.reset_positions", "true"]
# transformers' attention in float64 where it has one (SDPA), else its eager code
IMPLEMENTATION = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    here = tmp_path_factory.mktemp("hf_attention")
    return {arch: make(arch, here / arch) for arch in IMPLEMENTATION}


@pytest.fixture(scope="module")
def batch():
    """The inputs, targets and documents of composer's first step with STEP's settings
    (packed paragraphs; a target that starts a document is not trained)."""
    loader = DataLoader("tinyshakespeare", build_tokenizer("byte"), SEQ, BATCH, 0, 1,
                        split="train", val_fraction=0.05, document_mask=True)
    inputs, targets, documents = loader.next_batch()
    assert (documents[:, -1] > documents[:, 0]).all()  # a boundary in every row
    return inputs, targets, documents


def reference(folder, arch: str, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation=IMPLEMENTATION[arch], **config)


def loss_of(model, inputs, targets, **kwargs) -> float:
    """transformers' logits -> the mean cross-entropy of the trained targets. Without a
    cache: transformers looks for packed sequences in the positions only then."""
    with torch.no_grad():
        logits = model(inputs, use_cache=False, **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def explicit_mask(documents: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, S, S] bool: a query sees the keys of its document at or before it (and
    fewer than ``window`` positions before it)."""
    i = torch.arange(documents.shape[1])
    allowed = (i[None, :] <= i[:, None]) & (documents[:, :, None] == documents[:, None, :])
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return allowed[:, None]


def first_loss(folder, tmp_path, *args: str) -> float:
    return train(tmp_path, 1, [*STEP, "--model.hf_path", str(folder), *args])[0]["loss"]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_packed_documents_are_transformers_packed_sequences(arch, folders, batch, tmp_path):
    """data.document_mask with data.reset_positions equals transformers given the
    positions restarting per document (its packed-sequence mask); without
    reset_positions, transformers given the explicit 4D mask. Mistral's sliding window
    combines with the documents, and is real: without it the loss differs."""
    inputs, targets, documents = batch
    positions = document_positions(documents)
    ours_reset = first_loss(folders[arch], tmp_path / "reset", *RESET)
    ours = first_loss(folders[arch], tmp_path / "plain")
    model = reference(folders[arch], arch)
    window = getattr(model.config, "sliding_window", None)
    assert ours_reset == pytest.approx(loss_of(model, inputs, targets, position_ids=positions),
                                       rel=1e-9, abs=0)
    mask = explicit_mask(documents, window)
    assert ours == pytest.approx(loss_of(model, inputs, targets, attention_mask=mask),
                                 rel=1e-9, abs=0)
    across = loss_of(model, inputs, targets)  # documents seeing each other
    assert abs(across - ours) > 1e-4 * ours
    if window is not None:
        unbounded = reference(folders[arch], arch, sliding_window=None)
        assert abs(loss_of(unbounded, inputs, targets, position_ids=positions) - ours_reset) > (
            1e-4 * ours_reset)


def float64_softmax(x, dim=None, dtype=None, **kwargs):
    """``F.softmax`` that keeps float64: transformers' eager attention casts its softmax to
    float32, which alone moves the loss by about 1e-8."""
    return torch.softmax(x, dim=dim)


def test_gemma2_soft_capping_scaled_tied_embeddings_train_as_transformers(folders, batch,
                                                                         tmp_path):
    """Gemma2 (attention and final logits soft-capped, scaled embeddings, a tied head, a
    sliding window on alternate layers) with packed documents: composer's first loss is
    transformers' eager one, its softmax kept in float64, at 1e-9 (and as shipped,
    softmax in float32, at 1e-6). Each feature bites: the loss without it differs."""
    inputs, targets, documents = batch
    positions = {"position_ids": document_positions(documents)}
    ours = first_loss(folders["gemma2"], tmp_path, *RESET)
    model = reference(folders["gemma2"], "gemma2")
    assert ours == pytest.approx(loss_of(model, inputs, targets, **positions), rel=1e-6, abs=0)
    with mock.patch.object(F, "softmax", float64_softmax):
        assert ours == pytest.approx(loss_of(model, inputs, targets, **positions), rel=1e-9,
                                     abs=0)
        for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                       {"layer_types": ["full_attention"] * 4}):
            without = loss_of(reference(folders["gemma2"], "gemma2", **change), inputs,
                              targets, **positions)
            assert abs(without - ours) > 1e-4 * ours, change


def test_attention_sinks_train_as_transformers(folders, batch, tmp_path):
    """gpt-oss passes attention its sinks (``s_aux``, one logit per head): composer's
    first loss with packed documents is transformers' own at 1e-9, and without the
    sinks it differs. (gpt-oss builds its masks without the positions, so transformers
    is given them: one per kind of layer, additive, as its eager attention adds them.)"""
    inputs, targets, documents = batch
    ours = first_loss(folders["gpt_oss"], tmp_path)
    model = reference(folders["gpt_oss"], "gpt_oss")
    masks = {"attention_mask": {
        kind: torch.zeros(inputs.shape[0], 1, SEQ, SEQ, dtype=torch.float64).masked_fill(
            ~explicit_mask(documents, window), float("-inf"))
        for kind, window in (("full_attention", None),
                             ("sliding_attention", model.config.sliding_window))}}
    assert ours == pytest.approx(loss_of(model, inputs, targets, **masks), rel=1e-9, abs=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    assert abs(loss_of(model, inputs, targets, **masks) - ours) > 1e-4 * ours


@pytest.mark.parametrize("model_type,line", [
    ("inkling_text", "InklingAttention passes attention the argument 'position_bias', which "
                     "composer's attention cannot honour"),
    ("doge", "DogeAttention builds an attention mask of its own, which composer's attention "
             "does not take"),
])
def test_what_attention_cannot_honour_runs_transformers_own(model_type, line, tmp_path, capsys):
    """A model whose attention call composer's attention cannot honour (found when it is
    built at validation: one token through the meta model) runs transformers' own eager
    attention; packed documents, which need composer's, are refused in one line naming
    why, and left off by data.document_mask=auto."""
    from composer.cli.run import run_argv
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128)
    config.save_pretrained(tmp_path)
    args = ["--model.name", "hf", "--validate", "--model.hf_path", str(tmp_path)]
    assert run_argv([*args, "--data.document_mask", "true"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.document_mask=true: {line}; allowed: false")
    assert run_argv(args) == 0


@pytest.mark.parametrize("options", [{}, {"window": 5}, {"softcap": 2.0},
                                     {"window": 5, "softcap": 2.0, "sinks": True}])
def test_a_chunk_over_the_keys_before_it_is_the_rows_of_the_whole(options):
    """Context parallel's all-gather without documents: a chunk of queries over the keys
    up to its end, aligned to the lower right (LOWER_RIGHT), gives those
    rows of the whole sequence's attention, with a window, soft-capping and sinks too
    (float64, gradients too)."""
    from composer.models.common.mask import LOWER_RIGHT
    from composer.models.hf.attention import Core
    torch.manual_seed(0)
    q = torch.randn(2, 4, 24, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(4, dtype=torch.float64)
    whole = Core()(q, k, v, **options)
    for start, end in ((0, 6), (12, 18)):
        chunk = Core()(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                       LOWER_RIGHT, **options)
        torch.testing.assert_close(chunk, whole[:, :, start:end], rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(chunk)
        for a, b in zip(torch.autograd.grad(chunk, (q, k, v), grad),
                        torch.autograd.grad(whole[:, :, start:end], (q, k, v), grad,
                                            retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_flex_on_a_hugging_face_model_is_refused_at_validation(tmp_path, capsys):
    """transformers' attention takes no FlexAttention block mask from composer: --validate
    (no process group, nothing built) refuses model.attention=flex in one line."""
    from composer.cli.run import run_argv
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128)
    config.save_pretrained(tmp_path)
    assert run_argv(["--model.name", "hf", "--validate", "--model.hf_path", str(tmp_path),
                     "--model.attention", "flex"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: model.attention='flex': model 'hf' has attention that takes no FlexAttention "
        "block mask; allowed: auto, sdpa")

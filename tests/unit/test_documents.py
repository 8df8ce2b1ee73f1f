"""Document masking: packed documents attend only inside themselves, no target
crosses into the next one, and a packed window scores exactly as its documents
do one at a time (float64, relative 1e-12)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from composer.data import IGNORE_INDEX, DataLoader
from composer.data.loader import document_positions
from composer.models import get_model_spec
from composer.testing.harness import PARITY, train

TEXTS = ["First document.", "A second, longer one follows it here.", "Third.",
         "And a fourth, so that windows cut through documents."]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_loader_numbers_documents_and_trains_no_target_across_them(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS * 3])
    masked = DataLoader(str(path), "byte", 24, 4, 0, 1, val_fraction=0, document_mask=True)
    plain = DataLoader(str(path), "byte", 24, 4, 0, 1, val_fraction=0)
    assert masked.documents and not plain.documents
    boundaries = 0
    for _ in range(3):
        inputs, targets, documents = masked.next_batch()
        plain_inputs, plain_targets = plain.next_batch()
        assert torch.equal(inputs, plain_inputs)
        # a new document begins at each bos (256), and only there
        starts = documents[:, 1:] != documents[:, :-1]
        assert torch.equal(starts, inputs[:, 1:] == 256)
        assert (documents[:, 1:] - documents[:, :-1]).max() <= 1
        # a target that is a document's bos (the token after an eos) is not trained
        crossing = plain_targets == 256
        assert torch.equal(targets == IGNORE_INDEX, crossing)
        assert torch.equal(targets[~crossing], plain_targets[~crossing])
        boundaries += int(crossing.sum())
    assert boundaries > 6


def test_the_stream_and_the_in_memory_loader_give_the_same_documents(tmp_path, monkeypatch):
    import composer.data.sources as sources
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS * 3])
    held = DataLoader(str(path), "byte", 20, 2, 0, 1, val_fraction=0, document_mask=True)
    real = sources.load_documents

    def streamed(*args, **kwargs):  # the same rows, walked as a hub dataset would be
        documents = real(*args, **kwargs)
        documents.local = False
        return documents
    monkeypatch.setattr("composer.data.loader.load_documents", streamed)
    walked = DataLoader(str(path), "byte", 20, 2, 0, 1, val_fraction=0, document_mask=True)
    for _ in range(5):
        for ours, theirs in zip(held.next_batch(), walked.next_batch()):
            assert torch.equal(ours, theirs)


def test_positions_restart_at_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 2, 2]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                                      [0, 1, 2, 3, 4, 5, 0, 1]]


def packed_and_alone(name: str, lengths: list[int]):
    """A float64 debug model of ``name``, a window packed from documents of
    ``lengths`` (their tokens, targets and numbers) and each document alone."""
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(spec.flavors["debug"]).double()
    model.init_weights()
    docs = [torch.randint(0, 256, (n,)) for n in lengths]
    tokens = torch.cat(docs)[None]
    numbers = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    targets = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])[None]
    return model, tokens, targets, numbers, docs


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("reset", [True, False])
def test_a_packed_window_scores_as_its_documents_one_at_a_time(name, reset):
    """With the mask, each document's logits and the window's summed loss are
    those of the documents run alone (relative 1e-12), with positions restarting
    or not (rotary attention sees only relative positions); without it they are not."""
    model, tokens, targets, numbers, docs = packed_and_alone(name, [7, 12, 13])
    positions = document_positions(numbers) if reset else None
    with torch.no_grad():
        packed = model(tokens, positions=positions, documents=numbers)[0]
        alone = [model(d[None])[0] for d in docs]
        causal = model(tokens)[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(causal, torch.cat(alone), rtol=1e-3)
    packed_loss = F.cross_entropy(packed, targets[0], reduction="sum", ignore_index=IGNORE_INDEX)
    alone_loss = sum(F.cross_entropy(a[:-1], d[1:], reduction="sum") for a, d in zip(alone, docs))
    assert packed_loss.item() == pytest.approx(alone_loss.item(), rel=1e-12)


SFT = [{"prompt": "Repeat: kill\n", "response": "kill kill"},
       {"prompt": "Reverse: lodges\n", "response": "segdol"},
       {"prompt": "Q: 2+2?\n", "response": "4"}]


def test_packed_sft_with_the_mask_trains_like_padded_sft(tmp_path):
    """The same three examples, packed into one window (masked, positions reset)
    or padded one per window: the same loss and gradient norm every step."""
    path = write_jsonl(tmp_path / "sft.jsonl", SFT)
    width = sum(2 + len(r["prompt"]) + len(r["response"]) for r in SFT)  # bos ... eos
    common = [*PARITY, "--data.format", "sft", "--data.dataset", str(path), "--data.seq_len",
              str(width - 1), "--data.val_fraction", "0", "--training.steps", "3"]
    packed = train(tmp_path / "packed", 1, [*common, "--data.sft_packing", "true",
                                             "--data.reset_positions", "true",
                                             "--training.local_batch_size", "1"])
    padded = train(tmp_path / "padded", 1, [*common, "--training.local_batch_size", "3"])
    assert packed[0]["loss"] == pytest.approx(padded[0]["loss"], rel=1e-12)
    for ours, theirs in zip(packed, padded, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-9)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-9)
    assert packed[-1]["loss"] < packed[0]["loss"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernel needs CUDA")
def test_flex_attention_on_cuda_matches_the_explicit_mask():
    from composer.models.common import CausalAttention, DocumentMask, document_mask
    torch.manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    documents = (torch.rand(2, 256, device="cuda") < 0.02).cumsum(1)
    block_mask = DocumentMask(flex=True)(documents, q)  # a FlexAttention BlockMask
    ours = CausalAttention()(q, k, v, block_mask)
    reference = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        attn_mask=document_mask(documents))
    torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2)


def test_flex_attention_on_cpu_matches_the_explicit_mask_forward_and_backward():
    """The CUDA test's twin: eager FlexAttention on CPU (its device check on inputs that
    require grad lifted by composer.torch_compat) under the documents' BlockMask, and under
    none (causal), against SDPA with the dense mask, gradients included (float64)."""
    from composer.models.common import CausalAttention, DocumentMask, document_mask
    torch.manual_seed(0)
    q = torch.randn(2, 8, 256, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 4, 256, 16, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    documents = (torch.rand(2, 256) < 0.02).cumsum(1)
    grad = torch.randn(2, 8, 256, 16, dtype=torch.float64)
    flex = CausalAttention(flex=True)
    for mask, dense in ((DocumentMask(flex=True)(documents, q), document_mask(documents)),
                        (None, torch.ones(256, 256, dtype=torch.bool).tril())):
        ours = flex(q, k, v, mask)
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad),
                        torch.autograd.grad(reference, (q, k, v), grad)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

"""Evaluation under CP (:func:`cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval`) equals one process per document.

Oracle: Hugging Face's ``DeepseekV4ForCausalLM`` in the test process on each document alone
(batch 1, positions from 0), float64 with its float32 casts lifted and the indexer's ties to
the earlier entry (``hf_oracle``): per document the summed next-token cross-entropy over its
valid labels and their count; per token ``log_softmax`` at its next label and the argmax. The
CP side runs on the shared 4-rank gloo group at cp 1-4 (the groups of ranks 0..cp-1): balanced
layout with the need exchange, contiguous with allgather and zigzag with need (both padded
with :func:`cpkv.pad_documents`), labels with ``-100`` tokens, an empty document, 5-token
score chunks. Every rank's result is compared (the same on every rank).

Forward only, at cp 2: under ``torch.no_grad()`` the evaluation call and the training loss
call with ``indexer_loss=True`` save no tensor for backward (counted with
``saved_tensors_hooks``: 0; the same calls with gradients save some), the loss call returns no
indexer loss (its KL work skipped), and the forward's peak of live storages
(:class:`cpkv.bench.memory.LiveBytes`) is below the training forward's.

Tolerances: only summation order in float64 differs through three layers (test_transformers_lm.py
measures <= 2e-15 on a mean loss of ~4 and <= 2e-13 relative on gradients); the per-document
sums reach ~100 (30 terms), so bounds 1e-11 on them and 1e-12 on each log-probability (~5) leave
two to three orders of margin; a label shifted across documents or a missing rank's tokens moves
them by > 1e-2. Counts and argmax exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")

from tests.integrations import hf_oracle  # noqa: E402
from tests.integrations.test_transformers_lm import IGNORE, PAD_LENGTHS, _batch, _model, _no_mask  # noqa: E402
from tests.shared_spawn import shared_spawn  # noqa: E402

NLL_ABS, LOG_PROB_ABS, CHUNK = 1e-11, 1e-12, 5
CASES = (("balanced", "need"), ("contiguous", "allgather"), ("zigzag", "need"))


def _padded(case: str, cp: int) -> dict[str, Any]:
    """The batch of PAD_LENGTHS (an empty document, -100 labels), padded for the layout (contiguous: cp, zigzag: 2 cp)."""
    from cpkv.plan.conventions import pad_documents

    batch = _batch(PAD_LENGTHS, 5)
    if case == "balanced":
        return {"ids": batch["ids"], "labels": batch["labels"], "cu": batch["cu"], "padding": None}
    padded = pad_documents(torch.stack([batch["ids"], batch["labels"]], dim=1), batch["cu"], cp * (2 if case == "zigzag" else 1))
    return {"ids": padded.x[:, 0], "labels": padded.x[:, 1], "cu": padded.cu_seqlens, "padding": padded.padding}


def _counted(call: Any) -> tuple[Any, int, int]:
    """``call()``'s result, the tensors it saved for backward (count) and its peak of live storages (bytes)."""
    from cpkv.bench.memory import LiveBytes

    saved = []
    live = LiveBytes()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t), live:
        result = call()
    return result, len(saved), live.peak


def _ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from cpkv.integrations.causal_lm_eval import deepseek_v4_causal_lm_eval
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss, enable_deepseek_v4_cp

    torch.set_num_threads(1)
    model = enable_deepseek_v4_cp(_model()).eval()
    groups = {cp: dist.new_group(list(range(cp))) for cp in range(1, world + 1)}  # every rank makes every group
    results: dict[str, Any] = {}
    with hf_oracle.lifted(), _no_mask():
        for cp, group in groups.items():
            if rank >= cp:
                continue
            for layout, exchange in CASES:
                b = _padded(layout, cp)
                out = deepseek_v4_causal_lm_eval(model, b["ids"], group, cu_seqlens=b["cu"], labels=b["labels"], layout=layout,
                                                  exchange=exchange, padding=b["padding"], backend="reference", chunk_size=CHUNK,
                                                  return_tokens=True)
                results[f"{layout}/{exchange}/cp{cp}"] = {k: getattr(out, k) for k in ("nll", "num_tokens", "log_probs", "predictions",
                                                                                        "labels")}
        if rank < 2:  # forward only, at cp 2
            b = _padded("balanced", 2)
            common = dict(cu_seqlens=b["cu"], labels=b["labels"], backend="reference", chunk_size=CHUNK)
            for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
                with mode():
                    _, saved, peak = _counted(lambda: deepseek_v4_causal_lm_eval(model, b["ids"], groups[2], **common))
                results[f"eval/{name}"] = (saved, peak)
            with torch.no_grad():
                out, saved, peak = _counted(lambda: deepseek_v4_causal_lm_loss(model, b["ids"], groups[2], indexer_loss=True, **common))
            results["loss/no_grad"] = (saved, peak, len(out.indexer_losses), float(out.lm_loss))
            out, saved, peak = _counted(lambda: deepseek_v4_causal_lm_loss(model, b["ids"], groups[2], indexer_loss=True, **common))
            results["loss/grad"] = (saved, peak, len(out.indexer_losses), float(out.lm_loss))
    return results


FOUR_RANKS = shared_spawn(_ranks, 4, timeout=240.0)


@pytest.fixture(scope="module")
def four_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return FOUR_RANKS.run(request)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """Per document: summed NLL, valid count; per token of the unpadded batch: label log-probability, argmax, shifted label."""
    batch = _batch(PAD_LENGTHS, 5)
    model = _model()
    nll, counts, log_probs, argmax, labels = [], [], [], [], []
    with torch.no_grad(), hf_oracle.lifted(), hf_oracle.earlier_ties():
        for start, end in zip(batch["cu"][:-1].tolist(), batch["cu"][1:].tolist()):
            shifted = torch.cat([batch["labels"][start + 1: end], torch.tensor([IGNORE])])[: end - start]
            labels.append(shifted)
            counts.append(int((shifted != IGNORE).sum()))
            if end == start:
                nll.append(0.0)
                continue
            logits = model(input_ids=batch["ids"][start:end][None], use_cache=False).logits[0]
            lp = torch.log_softmax(logits, dim=-1).gather(1, shifted.clamp(min=0)[:, None])[:, 0]
            lp = torch.where(shifted != IGNORE, lp, 0)
            nll.append(float(-lp.sum()))
            log_probs.append(lp)
            argmax.append(logits.argmax(-1))
    return {"nll": torch.tensor(nll, dtype=torch.float64), "num_tokens": torch.tensor(counts), "log_probs": torch.cat(log_probs),
            "predictions": torch.cat(argmax), "labels": torch.cat(labels)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("case", [f"{layout}/{exchange}" for layout, exchange in CASES])
def test_evaluation_equals_one_process_per_document(four_ranks: list[dict[str, Any]], one_process: dict[str, Any],
                                                    case: str, cp: int) -> None:
    """Per-document NLL sums and counts, per-token log-probabilities, argmax and labels, on every rank of the group."""
    for rank in range(cp):
        got = four_ranks[rank][f"{case}/cp{cp}"]
        assert torch.equal(got["num_tokens"], one_process["num_tokens"])
        assert (got["nll"] - one_process["nll"]).abs().max() <= NLL_ABS, (got["nll"], one_process["nll"])
        assert torch.equal(got["labels"], one_process["labels"])
        assert (got["log_probs"] - one_process["log_probs"]).abs().max() <= LOG_PROB_ABS
        assert torch.equal(got["predictions"], one_process["predictions"])
        if rank:
            assert all(torch.equal(v, four_ranks[0][f"{case}/cp{cp}"][k]) for k, v in got.items())  # every rank the same
    assert int(one_process["num_tokens"].sum()) > 0 and one_process["num_tokens"][1] == 0  # -100s and an empty document


def test_a_forward_only_call_saves_nothing_and_skips_the_indexer_loss(four_ranks: list[dict[str, Any]]) -> None:
    """Under no_grad / inference_mode: 0 tensors saved, no indexer loss, a lower peak than the training forward, the same loss."""
    for rank in (0, 1):
        r = four_ranks[rank]
        assert r["eval/no_grad"][0] == 0 and r["eval/inference_mode"][0] == 0
        saved, peak, indexers, loss = r["loss/no_grad"]
        grad_saved, grad_peak, grad_indexers, grad_loss = r["loss/grad"]
        assert saved == 0 and grad_saved > 0  # the count can fail
        assert indexers == 0 and grad_indexers == 1  # the CSA layer's KL only with gradients
        assert peak < grad_peak and r["eval/no_grad"][1] < grad_peak, (peak, r["eval/no_grad"][1], grad_peak)
        assert abs(loss - grad_loss) <= 1e-14


@pytest.mark.timeout(200)
def test_perplexity_example_runs() -> None:
    """examples/perplexity_cp.py at 2,048 tokens: cp 4 equals one process (cp 1) and Hugging Face's model within its tolerances."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "examples" / "perplexity_cp.py"), "--tokens", "2048"],
                          capture_output=True, text=True, timeout=190, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "perplexity under CP matches one process" in proc.stdout
    perplexities = [float(x) for x in re.findall(r"^(?:cpkv|Hugging).*?\s(\d+\.\d{10})\s", proc.stdout, flags=re.M)]
    assert len(perplexities) == 3 and abs(perplexities[0] - perplexities[1]) <= 1e-8 * perplexities[1], proc.stdout

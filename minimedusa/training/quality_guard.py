"""Medusa-2's quality guard: how far joint training moved the model from the original.

The tuned backbone must stay the model users chose: on held-out answers, the mean next-token
KL(p_original || p_tuned) must stay under --max-kl, and the greedy continuations of both are
compared token by token. Both are reported beside those of the original model run in bfloat16,
a change everyone calls "the same model", as a yardstick. Here: the greedy agreement, the
bfloat16 yardstick and the verdict; the KL is joint_loss.mean_kl. Left out: task benchmarks.
"""
import copy

import torch

from minimedusa.training.lora import adapters_off, remove_adapters
from minimedusa.acceptance import Sampling
from minimedusa.training.self_distill import answer_batch


def original_in_bfloat16(model):
    """The original model (adapters removed) run in bfloat16 instead of float32: a change
    everyone calls "the same model". The quality guard's KL and greedy agreement are reported
    beside this copy's, as a yardstick."""
    reference = copy.deepcopy(model)
    remove_adapters(reference)
    return reference.to(torch.bfloat16)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def greedy_agreement(model, prompts: list[list[int]], candidate=None, n_tokens: int = 64,
                     batch_size: int = 16) -> dict:
    """Greedy continuations of the original (model with adapters off) and a candidate (default:
    the tuned model, adapters on), compared token by token: the mean fraction of each
    continuation that agrees before the first difference, and how many are identical."""
    stop = model.config.stop_ids
    candidate = model if candidate is None else candidate

    def greedy(m, chunk):
        return [a for a, _ in answer_batch(m, chunk, n_tokens, Sampling(), stop, None)]

    agree, same = [], 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        with adapters_off(model):
            original = greedy(model, chunk)
        for a, b in zip(original, greedy(candidate, chunk)):
            agree.append(common_prefix(a, b) / max(len(a), len(b)) if a or b else 1.0)
            same += a == b
    return {"agreement": sum(agree) / len(agree), "identical": same, "prompts": len(prompts)}


def quality_verdict(report: dict) -> str:
    """One line: the quality guard's numbers and whether the run may be called good."""
    agree, bf16 = report["greedy_agreement_64"], report["greedy_agreement_64_original_in_bfloat16"]
    numbers = (f"mean next-token KL from the original model {report['medusa2']['kl']:.4f} nats "
               f"(threshold {report['kl_threshold']}; the original model in bfloat16: "
               f"{report['kl_original_in_bfloat16']:.4f}), greedy agreement over 64 tokens "
               f"{agree['agreement']:.2f} ({agree['identical']}/{agree['prompts']} identical; "
               f"bfloat16: {bf16['agreement']:.2f}, {bf16['identical']}/{bf16['prompts']})")
    if report["good"]:
        return f"quality guard passed: {numbers}"
    return (f"error: quality guard FAILED, this run is not good and must not replace the "
            f"shipped defaults: {numbers}")

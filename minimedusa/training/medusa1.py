"""Training the Medusa heads on a frozen backbone: Medusa-1 (paper section 4).

    L = sum_{k=1..K} lambda_k * CE( p_t^(k), y_{t+k+1} ),   lambda_k = 0.8^k

Because the backbone is frozen, the hidden state h_t at every answer position was computed once,
while the self-distillation data was generated, and is read back here: training touches only
the heads (and, in the shared form, the frozen LM head they project with). Every training row is
one position t: its hidden state and the K tokens its heads must predict. Positions are
independent for the heads, so rows are shuffled freely. Only answer tokens are rows: the
prompt and the padding carry no loss by construction.
Here: the rows, the loss, its validation metrics, the learning-rate schedule, the heads Medusa-1
starts from and its flags; the training loop, shared with Medusa-2 (medusa2.py, which tunes the
backbone too), is train.py's, and what both share around it loop.py's.

Shapes: M rows (answer positions), C model dim, K heads, V vocab, B batch rows.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from minimedusa.errors import UserError, unreadable
from minimedusa.files.heads_files import load_heads
from minimedusa.files.outputs import check_out_is_not
from minimedusa.files.tokenizer import read_json_object
from minimedusa.cli.flags import non_negative, non_negative_int, positive_int
from minimedusa.heads import HydraHeads, MedusaHeads, as_features, drafting_lm_head, token_ids

IGNORE = -100  # target of a head whose token t+k+1 lies past the end of the answer


class DataError(UserError):
    """A self-distillation data folder that is empty, corrupt or made for another model."""


@dataclass
class Rows:
    hidden: torch.Tensor  # (M, C) bf16: h_t, the state that predicts answer token t+1
    targets: torch.Tensor  # (M, K) int64: targets[:, k-1] = y_{t+k+1} for head k, or IGNORE
    tokens: torch.Tensor | None = None  # (M, K) int64: y_{t+1}..y_{t+K}, what Hydra heads read


def head_targets(answer: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(n,) answer ids -> (n, K): row i holds answer[i + k] for head k = 1..K. note: row i's hidden
    state is the one that predicted answer[i] with the LM head (the token after position t is
    y_{t+1} = answer[i]); head k predicts k tokens further, y_{t+k+1}, which is answer[i + k].
    This off-by-k is the whole point of a Medusa head, and a test checks it.
    """
    n = answer.shape[0]
    padded = torch.cat([answer.long(), torch.full((num_heads,), IGNORE)])  # (n + K,)
    index = torch.arange(n).unsqueeze(1) + torch.arange(1, num_heads + 1)  # (n, K): i + k
    return padded[index]


def head_inputs(answer: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(n,) answer ids -> (n, K): row i holds answer[i + k - 1] for k = 1..K, the tokens a Hydra
    head k reads beside h_t (heads.HydraHeads): the root y_{t+1} = answer[i], then the draft's
    tokens up to y_{t+k}, one before its target answer[i + k]. Past the end: 0, where every
    target is IGNORE.
    """
    n = answer.shape[0]
    padded = torch.cat([answer.long(), torch.zeros(num_heads, dtype=torch.long)])  # (n + K,)
    return padded[torch.arange(n).unsqueeze(1) + torch.arange(num_heads)]


def read_meta(folder: Path) -> dict:
    path = folder / "meta.json"
    if not path.is_file():
        raise DataError(f"no meta.json in {folder}: not a self-distillation data folder")
    return read_json_object(path)  # one line where it is not a JSON object


def read_answers(folder: Path, tokenizer_fingerprint: str, vocab_size: int,
                 with_hidden: bool = True) -> list[tuple]:
    """Every answer of every shard, in order: (prompt ids (p,), answer ids (n,), hidden (n, C)
    or None). Checks that the data was made for this tokenizer and model."""
    meta = read_meta(folder)
    if meta.get("tokenizer") != tokenizer_fingerprint:
        raise DataError(f"{folder} was made with another tokenizer "
                        f"({meta.get('tokenizer')} != {tokenizer_fingerprint})")
    shards = sorted(folder.glob("shard-*.safetensors"))
    if not shards:
        raise DataError(f"no shards in {folder}: run python -m minimedusa.training.self_distill "
                        "first")
    answers = []
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as st:
                prompts, p_offsets = st.get_tensor("prompt_ids"), st.get_tensor("prompt_offsets")
                ids, offsets = st.get_tensor("answer_ids"), st.get_tensor("answer_offsets")
                hidden = st.get_tensor("hidden") if with_hidden else None
        except Exception as e:  # safetensors reports truncation/corruption with varied types
            raise DataError(unreadable(shard, e)) from None
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise DataError(f"{shard} holds token ids beyond the model's vocabulary")
        for (pa, pb), (a, b) in zip(zip(p_offsets[:-1].tolist(), p_offsets[1:].tolist()),
                                    zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            answers.append((prompts[pa:pb].long(), ids[a:b].long(),
                            hidden[a:b] if with_hidden else None))
    if len(answers) < 2:
        raise DataError(f"{folder} holds {len(answers)} answer(s): too few to train and validate")
    return answers


def held_out_count(n_answers: int) -> int:
    """How many of a folder's n answers train.py holds out: 1 in 20, at least one."""
    return max(1, n_answers // 20)


def split_validation(answers: list) -> tuple[list, list]:
    """(train, validation): the last 1 in 20 answers are held out (whole answers, so no
    validation position shares an answer with a training one)."""
    n_val = held_out_count(len(answers))
    return answers[:-n_val], answers[-n_val:]


def read_rows(folder: Path, num_heads: int, tokenizer_fingerprint: str,
              vocab_size: int) -> tuple[Rows, Rows]:
    """(train, validation) rows from every shard's stored hidden states. The states are read
    into one tensor, a shard at a time, the validation rows its tail: a large folder's states
    (5 GB for 4.6M answer tokens) are never held twice, as concatenating answers would."""
    answers = read_answers(folder, tokenizer_fingerprint, vocab_size, with_hidden=False)
    train, val = split_validation(answers)
    hidden = stacked_hidden(folder, sum(len(a) for _, a, _ in answers))  # (M, C)
    m = sum(len(a) for _, a, _ in train)
    return (Rows(hidden[:m], *answer_tokens(train, num_heads)),
            Rows(hidden[m:], *answer_tokens(val, num_heads)))


def stacked_hidden(folder: Path, rows: int) -> torch.Tensor:
    """Every shard's hidden states, in order, in one (rows, C) tensor filled shard by shard."""
    hidden, at = None, 0
    for shard in sorted(folder.glob("shard-*.safetensors")):
        try:
            with safe_open(shard, framework="pt") as st:
                part = st.get_tensor("hidden") if "hidden" in st.keys() else None  # (n, C)
        except Exception as e:  # safetensors reports truncation/corruption with varied types
            raise DataError(unreadable(shard, e)) from None
        if part is None:
            raise DataError(f"{shard} holds token ids alone: recompute its hidden states "
                            "(python -m minimedusa.training.rehidden)")
        if hidden is None:
            hidden = torch.empty(rows, part.shape[-1], dtype=part.dtype)
        if part.dim() != 2 or at + len(part) > rows or part.shape[1] != hidden.shape[1]:
            raise DataError(f"{shard}: its hidden states do not match its answers' tokens")
        hidden[at:at + len(part)] = part
        at += len(part)
    if at != rows:
        raise DataError(f"{folder}: {at} hidden states for {rows} answer tokens")
    return hidden


def answer_tokens(answers: list[tuple], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets (M, K), the tokens Hydra heads read (M, K)) of answers, answer after answer."""
    return (torch.cat([head_targets(a, num_heads) for _, a, _ in answers]),
            torch.cat([head_inputs(a, num_heads) for _, a, _ in answers]))


def rows_of(answers: list[tuple], num_heads: int) -> Rows:
    """The rows of answers (prompt ids, answer ids (n,), hidden (n, C)), answer after answer."""
    return Rows(torch.cat([h for _, _, h in answers]), *answer_tokens(answers, num_heads))


def head_logits(heads, hidden: torch.Tensor, tokens: torch.Tensor | None, model,
                vocabulary=None) -> torch.Tensor:
    """Every head's logits (K, B, V) at B answer positions, h_t (B, C); (K, B, V') over a
    draft vocabulary (heads.DraftVocabulary) if one is given. Hydra heads are teacher-forced:
    they read the answer's own tokens y_{t+1}..y_{t+K} (B, K), which is what a correct draft
    holds. heads: the heads, or the heads wrapped by DistributedDataParallel."""
    lm_head = drafting_lm_head(vocabulary, model.lm_head)
    hidden = as_features(heads, hidden)
    if getattr(heads, "module", heads).config.head_kind in ("hydra", "hydra++"):
        return heads(hidden, tokens, model.embed, lm_head)
    return heads(hidden, lm_head)


def draft_columns(targets: torch.Tensor, vocabulary) -> torch.Tensor:
    """Target token ids -> their columns in the draft vocabulary's logits (V'); a token outside
    it can never be guessed: IGNORE, no loss (the accuracy still counts it as a miss)."""
    if vocabulary is None:
        return targets
    lookup = torch.full((vocabulary.vocab_size,), IGNORE, device=targets.device)
    lookup[vocabulary.ids] = torch.arange(len(vocabulary.ids), device=targets.device)
    return torch.where(targets == IGNORE, IGNORE, lookup[targets.clamp(min=0)])


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, decay: float = 0.8):
    """sum_k decay^k CE_k. head_logits (K, B, V), targets (B, K).

    Returns (the weighted loss, per-head CE (K,), per-head count of rows with a target (K,)).
    """
    K = head_logits.shape[0]
    ce = torch.stack([F.cross_entropy(head_logits[k].float(), targets[:, k],
                                      ignore_index=IGNORE) for k in range(K)])  # (K,)
    counted = (targets != IGNORE).sum(dim=0)  # (K,)
    ce = torch.where(counted > 0, ce, 0.0)  # a head with no target in the batch adds nothing
    weights = decay ** torch.arange(1, K + 1, device=ce.device, dtype=ce.dtype)  # lambda_k
    return (weights * ce).sum(), ce.detach(), counted


def teacher_states(hidden: torch.Tensor, index: torch.Tensor, num_heads: int) -> torch.Tensor:
    """h_{t+k} for k = 1..K at rows `index` (M,) of the rows' hidden states (R, C): (K, M, C).
    Row t + k predicted y_{t+k+1}, head k's target: where head k has a target, that row is in
    the same answer (the target is its root token); elsewhere it is any row, and unused."""
    k = torch.arange(1, num_heads + 1).unsqueeze(1)  # (K, 1)
    return hidden[(index.unsqueeze(0) + k).clamp(max=hidden.shape[0] - 1)]


def distill_loss(head_logits: torch.Tensor, teacher_hidden: torch.Tensor, targets: torch.Tensor,
                 lm_head: torch.nn.Module, vocabulary=None, decay: float = 0.8):
    """sum_k decay^k CE(p_base(. | y_<=t+k), p^(k)): head k learns the backbone's whole
    next-token distribution at t + k, softmax(W_lm h_{t+k}), instead of the one token the data
    holds there (Hydra++'s teacher loss; train.py --distill), over the draft vocabulary's
    columns if there is one (the teacher renormalised there). head_logits (K, M, V'),
    teacher_hidden (K, M, C) (teacher_states), targets (M, K). Returns what medusa_loss returns.
    """
    teacher = F.log_softmax(drafting_lm_head(vocabulary, lm_head)(teacher_hidden).float(), -1)
    student = F.log_softmax(head_logits.float(), dim=-1)  # (K, M, V')
    has = targets.T != IGNORE  # (K, M): row t + k is in the answer
    ce = -(teacher.exp() * student).sum(-1)  # (K, M)
    counted = has.sum(dim=1)
    ce = (ce * has).sum(dim=1) / counted.clamp(min=1)
    weights = decay ** torch.arange(1, ce.shape[0] + 1, device=ce.device, dtype=ce.dtype)
    return (weights * ce).sum(), ce.detach(), counted


def topk_hits(head_logits: torch.Tensor, targets: torch.Tensor, k: int,
              vocabulary=None) -> torch.Tensor:
    """Per head, how many rows have their target among the head's top-k: (K,)."""
    top = token_ids(vocabulary, head_logits.topk(k, dim=-1).indices)  # (K, B, k)
    hit = (top == targets.T.unsqueeze(-1)).any(dim=-1) & (targets.T != IGNORE)  # (K, B)
    return hit.sum(dim=1)


@torch.no_grad()
def head_metrics(heads, model, rows: Rows, device, batch_size: int = 1024,
                 vocabulary=None) -> dict:
    """Per-head validation loss and top-1 / top-5 accuracy over all `rows` (the loss over the
    draft vocabulary's columns, if there is one, the accuracy over every target)."""
    K = rows.targets.shape[1]
    ce_sum, n_ce, n, top1, top5 = (torch.zeros(K) for _ in range(5))
    for a in range(0, rows.targets.shape[0], batch_size):
        hidden = rows.hidden[a:a + batch_size].to(device)  # (B, C)
        targets = rows.targets[a:a + batch_size].to(device)  # (B, K)
        tokens = None if rows.tokens is None else rows.tokens[a:a + batch_size].to(device)
        logits = head_logits(heads, hidden, tokens, model, vocabulary)  # (K, B, V)
        _, ce, counted = medusa_loss(logits, draft_columns(targets, vocabulary))
        ce_sum += (ce * counted).cpu()
        n_ce += counted.cpu()
        n += (targets != IGNORE).sum(dim=0).cpu()
        top1 += topk_hits(logits, targets, 1, vocabulary).cpu()
        top5 += topk_hits(logits, targets, 5, vocabulary).cpu()
    n, n_ce = n.clamp(min=1), n_ce.clamp(min=1)
    return {"loss": (ce_sum / n_ce).tolist(), "top1": (top1 / n).tolist(),
            "top5": (top5 / n).tolist()}


def cosine_lr(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up to peak, then cosine decay to 0 at `total` (paper: cosine with warmup)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * min(progress, 1.0))).item())


# --- Medusa-1's flags and the heads it starts from ----------------------------------------------

def add_flags(p) -> None:
    """Medusa-1's own flags, in their group of train.py's --help."""
    m1 = p.add_argument_group("Medusa-1 (with --frozen)")
    m1.add_argument("--kind", choices=("medusa", "hydra", "hydra++"), default=None,
                    help="medusa: the paper's heads, each reads h_t alone (default with --data); "
                    "hydra: each also reads the tokens drafted before it (heads.HydraHeads; "
                    "default from the model alone); hydra++: Hydra heads behind one decoder "
                    "layer over the whole accepted sequence (experiments/draft_layer.py; with "
                    "--init-heads of the hydra kind, those heads behind a fresh layer)")
    m1.add_argument("--distill", action="store_true", help="learn the backbone's whole "
                    "next-token distribution (read off the stored hidden states) instead of the "
                    "data's one token: Hydra++'s teacher loss (default: cross-entropy on tokens)")
    m1.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                    help="the heads rank "
                    "only the N tokens most frequent in the training answers, as they will draft "
                    "(a fraction of the LM head's cost; the config makes it the heads' default); "
                    "0 = the whole vocabulary (default with --data; from the model alone: 8192)")
    m1.add_argument("--heads", type=positive_int, default=4, help="number of heads K (default: 4; "
                    "Medusa-2 keeps the form of --init-heads)")
    m1.add_argument("--layers", type=positive_int, default=None,
                    help="residual blocks per head (default: 1; from the model alone: 2)")
    m1.add_argument("--shared", action="store_true",
                    help="heads share the backbone's LM head instead of own projections")
    m1.add_argument("--batch-size", type=positive_int, default=256,
                    help="answer positions per optimizer step (default: 256; --kind hydra++: "
                    "drawn from a few whole answers: experiments/draft_layer_rows.py)")
    m1.add_argument("--lr", type=non_negative, default=None, help="the heads' peak learning rate "
                    "(default: 1e-3; from the model alone: 2e-3)")


# --kind -> fresh heads of it for the model, in the paper's initialisation; and the kinds that
# start from trained heads of another kind (Hydra++: Hydra heads behind a fresh draft layer).
# experiments/ registers its own (experiments/draft_layer_rows.py)
FRESH_HEADS = {"medusa": lambda model, a: MedusaHeads.for_model(model, a.heads, a.layers,
                                                                  a.shared),
               "hydra": lambda model, a: HydraHeads.for_model(model, a.heads, a.layers)}
FROM_TRAINED: dict = {}


def medusa1_heads(args, model) -> MedusaHeads:
    """Fresh heads in the paper's initialisation or, with --init-heads, trained ones (in
    --kind where that kind starts from them)."""
    if args.init_heads is None:
        return FRESH_HEADS[args.kind](model, args)
    check_out_is_not(args.out, args.init_heads)
    heads = load_heads(args.init_heads, model)
    if args.kind in FROM_TRAINED:
        heads = FROM_TRAINED[args.kind](heads, model)
    return heads.requires_grad_(True)

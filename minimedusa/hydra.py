"""Hydra heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa
Decoding"): Medusa heads that see the draft.

A Medusa head k guesses token t+k+1 from h_t alone: it never sees the root token t+1, which the
backbone has already chosen exactly when the heads run, nor the guesses of the heads before it.
A Hydra head k also reads the input embeddings of the tokens on its path: the root x_{t+1} and
the candidates x_{t+2}, ..., x_{t+k} at depths 1..k-1:

    z^(k) = h_t + U^(k) · [E(x_{t+1}); ...; E(x_{t+k})]        (U^(k): C x kC)
    p^(k) = softmax( W_lm · Blocks^(k)(z^(k)) )

E is the backbone's input embedding and W_lm its LM head, both frozen and shared by every head;
Blocks^(k) are L residual blocks, as in a Medusa head (heads.py). U^(k) starts at zero, so a fresh
Hydra head is exactly a fresh shared-projection Medusa head: training only adds what the tokens
tell. The price: head k needs the candidates of depth k-1, so drafting a tree runs depth by
depth, one batched head call per depth over the nodes of the previous depth (hydra_candidates),
where the Medusa heads make one call for every depth. Training stays one call per batch:
teacher forcing feeds each head the true answer tokens, which is what a correct draft holds.

Shapes: B rows, C model dim, V vocab (V' with a draft vocabulary), K heads, k a head's depth
(1..K), N tree nodes, M nodes that have children at one depth.
"""
import torch
import torch.nn as nn

from minimedusa.heads import MedusaConfig, ResBlock, drafting_lm_head, token_ids
from minimedusa.tree import MedusaTree


class HydraHead(nn.Module):
    """Head k: z = h + U [E(x_1); ...; E(x_k)], then L residual blocks (the LM head is shared)."""

    def __init__(self, depth: int, dim: int, num_layers: int):
        super().__init__()
        self.read = nn.Linear(depth * dim, dim, bias=False)  # U^(k)
        nn.init.zeros_(self.read.weight)  # the token part starts at zero: a Medusa head
        self.blocks = nn.Sequential(*[ResBlock(dim) for _ in range(num_layers)])

    def forward(self, hidden, path_embeddings):  # (..., C), (..., k * C) -> (..., C)
        return self.blocks(hidden + self.read(path_embeddings))


class HydraHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        assert cfg.head_kind in ("hydra", "hydra++") and cfg.shared_lm_head
        self.config = cfg
        self.heads = nn.ModuleList([HydraHead(k, cfg.hidden_size, cfg.medusa_num_layers)
                                    for k in range(1, cfg.medusa_num_heads + 1)])
        self.vocabulary = None  # a DraftVocabulary, set for decoding (cli/draft_heads.py)

    @classmethod
    def for_model(cls, model, num_heads: int, num_layers: int = 1) -> "HydraHeads":
        """Fresh heads: each predicts exactly what the LM head predicts at step 0."""
        cfg = MedusaConfig(num_heads, num_layers, model.config.hidden_size,
                           model.config.vocab_size, shared_lm_head=True, head_kind="hydra")
        weight = model.lm_head.weight
        return cls(cfg).to(device=weight.device, dtype=weight.dtype)

    def head(self, k: int, hidden: torch.Tensor, path: torch.Tensor, embed: nn.Embedding,
             lm_head: nn.Module) -> torch.Tensor:
        """Head k's logits: hidden (..., C) (broadcast over the rows of path), path (..., k)
        token ids x_{t+1}..x_{t+k} -> (..., V)."""
        emb = embed(path).flatten(-2)  # (..., k * C): the k embeddings side by side
        return lm_head(self.heads[k - 1](hidden.expand(*emb.shape[:-1], -1), emb))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embed: nn.Embedding,
                lm_head: nn.Module) -> torch.Tensor:
        """Every head's logits, teacher-forced: hidden (B, C), tokens (B, K) = the answer's
        x_{t+1}..x_{t+K} -> (K, B, V). Head k reads tokens[:, :k]."""
        return torch.stack([self.head(k, hidden, tokens[:, :k], embed, lm_head)
                            for k in range(1, len(self.heads) + 1)])


@torch.inference_mode()
def hydra_candidates(heads: HydraHeads, model, hidden: torch.Tensor, root: torch.Tensor,
                     tree: MedusaTree, pick=None) -> torch.Tensor:
    """The tree's tokens (N,), drafted depth by depth from h_t (C,) and the root token ().

    At depth d, head d runs once over the M nodes of depth d-1 that have children, each reading
    its own path's tokens; node p + (r,) gets the r-th best guess at its parent p (among the
    heads' draft vocabulary, if they have one). `pick(logits, k)`: the k guesses' columns,
    (M, V') -> (M, top_k), best first (default: the top k; speculative_sampling.py draws them)."""
    lm_head = drafting_lm_head(heads.vocabulary, model.lm_head)
    tokens = root.reshape(1).expand(tree.size).clone()  # (N,): filled in depth by depth
    for d in range(1, tree.num_heads + 1):
        parents, children, slot, rank = tree.drafting[d - 1]
        path = tokens[tree.ancestors[parents, :d]]  # (M, d): root .. parent
        logits = heads.head(d, hidden, path, model.embed, lm_head)  # (M, V')
        columns = logits.topk(tree.top_k, dim=-1).indices if pick is None else pick(logits,
                                                                                    tree.top_k)
        top = token_ids(heads.vocabulary, columns)  # (M, top_k)
        tokens[children] = top[slot, rank]
    return tokens

"""--acceptance, with --temperature, --top-p, --eps, --delta and --seed, read into the rule
decoding.medusa_decode verifies with (acceptance.py, speculative_sampling.py; on a CPU greedy
walked on the host, speed/host_greedy.py).
"""
import torch

from minimedusa import acceptance
from minimedusa.errors import UserError
from minimedusa.speculative_sampling import speculative
from minimedusa.speed.host_greedy import greedy_for


def acceptance_kind(args) -> str:
    """--acceptance as decoding runs it: 'auto' is greedy at temperature 0, above it lossless
    speculative sampling of drawn candidates (rejection sampling of the top guesses with
    ranked trees, which draw none); at temperature 0 every rule is greedy."""
    kind, temperature = args.acceptance, args.temperature
    ranked = args.tree is not None and args.tree.split(":")[0] == "ranked"
    if kind == "auto":
        kind = "greedy" if temperature == 0 else "rejection" if ranked else "speculative"
    if kind == "greedy" and temperature != 0:
        raise UserError("--acceptance greedy decodes at temperature 0: drop --temperature "
                        "or use --acceptance speculative, rejection or typical")
    if kind == "speculative" and ranked and temperature != 0:
        raise UserError("--acceptance speculative draws its candidates on the grown trees: "
                        "with --tree ranked use --acceptance rejection")
    return "greedy" if temperature == 0 and kind != "typical" else kind


def drawn_temperature(args) -> float | None:
    """The temperature the heads' candidates are drawn at (speculative sampling), else None."""
    return args.temperature if acceptance_kind(args) == "speculative" else None


def decoding_acceptance(args, device: torch.device) -> acceptance.Acceptance:
    """--acceptance (acceptance_kind), with --temperature, --top-p, --eps, --delta, --seed.
    Speculative sampling verifies what the draft drew (each step's Candidates carry it).
    Greedy on a CPU is walked on the host (speed/host_greedy.py: the same tokens, fewer
    operators)."""
    kind, temperature = acceptance_kind(args), args.temperature
    if kind == "typical":
        return acceptance.typical(temperature, args.eps, args.delta)
    if kind == "rejection":
        return acceptance.rejection(temperature, args.top_p, args.seed)
    if kind == "speculative":
        return speculative(temperature, args.top_p, args.seed)
    return greedy_for(device)

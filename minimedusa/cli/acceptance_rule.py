"""--acceptance, with --temperature, read into the rule a recipe names (recipe.Recipe's
acceptance; recipe.acceptance_of builds it, with --top-p, --eps, --delta and --seed).
"""
from minimedusa.errors import UserError


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

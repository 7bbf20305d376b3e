"""Experiments: measured, not shipped (weights/RESULTS.md), beside the core, which never imports
them. They plug in by one explicit call where what uses them starts, never by being imported:
register_decoding (the recipe, assembly/recipe.Recipe, before any heads are read) registers Hydra++'s heads
kind (files/heads_files.HEAD_KINDS: draft_layer.py); register_training (train.py and the tree
search, where they start) its training too (training/head_rows.ROWS, training/medusa1's
FRESH_HEADS and FROM_TRAINED: draft_layer_rows.py). The recipe also wraps Hydra++'s draft
(PlusPlusDraft), and bench/batches.py runs Medusa in a batch (batch_medusa.py); no other module
outside experiments/ imports it (tests/test_wings.py).
"""
from minimedusa.experiments import draft_layer


def register_decoding() -> None:
    """What decoding reads of the experiments: Hydra++'s heads files."""
    draft_layer.register()


def register_training() -> None:
    """What training reads of them: register_decoding's, and Hydra++'s training rows and heads."""
    from minimedusa.experiments import draft_layer_rows  # training's: not imported to decode
    register_decoding()
    draft_layer_rows.register()

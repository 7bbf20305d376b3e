"""Experiments: measured, not shipped (weights/RESULTS.md), beside the core, which never imports
them. They plug in here, in one place: importing this package registers Hydra++'s heads kind
(files/heads_files.HEAD_KINDS: draft_layer.py) and its training (training/head_rows.ROWS,
training/medusa1's FRESH_HEADS and FROM_TRAINED: draft_layer_rows.py); cli/recipe.py, which
imports it, wraps Hydra++'s draft (PlusPlusDraft), and bench/batches.py runs Medusa in a batch
(batch_medusa.py). No other module outside experiments/ imports it (tests/test_wings.py).
"""
from minimedusa.experiments import draft_layer, draft_layer_rows  # noqa: F401 (they register)

"""`decodekit eval`: lm-evaluation-harness with decodekit as its model. The map of the package (it imports none of
its modules, so lm-eval, an optional extra, is imported only when tasks are asked for):

- `harness`: lm-eval's optional import (an error naming the `eval` extra), tasks checked before anything runs, one
  evaluation and its figures (`TaskScores`);
- `model`: `DecodekitLM`, lm-eval's `LM` over a recipe, registered in lm-eval as "decodekit" when imported;
- `__main__`: `python -m decodekit.eval ...`, lm-eval's own command line with the "decodekit" model registered.
"""

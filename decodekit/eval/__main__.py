"""lm-eval's own command line with decodekit registered as a model:
`python -m decodekit.eval --model decodekit --model_args recipe=recipes/creative.yaml --tasks TASK ...` (lm-eval does
not find models through entry points, so its `lm_eval` command alone does not know "decodekit")."""

from __future__ import annotations

from decodekit.eval.harness import import_lm_eval


def main() -> None:
    """Register the "decodekit" model, then run lm-eval's command line on this process's arguments."""
    import_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    import decodekit.eval.model  # noqa: F401  (registers "decodekit" in lm-eval's model registry)

    cli_evaluate()


if __name__ == "__main__":
    main()

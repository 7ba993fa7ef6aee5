"""Entry point: ``python -m MaxText.train [extra.yml ...] key=value ...``.

Bad configuration (or a run that cannot fit its devices' memory) exits with code 2 and one line
naming the key; a run a guard stops (too many non-finite steps in a row) exits with code 3 and one
line naming the steps and the newest checkpoint.
"""

import sys

from MaxText.config import ConfigError, load_config_or_exit


def main(argv: list[str]) -> int:
    config = load_config_or_exit(argv)

    from MaxText.parallel.distributed import initialize_distributed, select_platform

    select_platform(config)
    initialize_distributed(config)
    from MaxText.checkpointing import CheckpointError
    from MaxText.train.health import EXIT_HALTED, TrainingHalted
    from MaxText.train.loop import train

    try:
        train(config)
    except (
        ConfigError,
        CheckpointError,
    ) as err:  # problems only visible with devices present (mesh vs device count, memory, ...)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingHalted as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_HALTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Entry point: ``python -m MaxText.train [extra.yml ...] key=value ...`` (``--help``, ``--help-keys``).

Bad configuration (or a run that cannot fit its devices' memory) exits with code 2 and one line
naming the key; a run a guard stops (too many non-finite steps in a row) exits with code 3 and one
line naming the steps and the newest checkpoint.
"""

import sys

from MaxText.config import ConfigError, load_config_or_exit


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        from MaxText.config_help import usage

        print(usage())
        return 0
    for i, arg in enumerate(argv):
        if arg == "--help-keys" or arg.startswith("--help-keys="):
            from MaxText.config_help import help_keys

            pattern = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else None)
            text, code = help_keys(pattern)
            print(text, file=sys.stderr if code else sys.stdout)
            return code
    config = load_config_or_exit(argv)

    import jax

    from MaxText.parallel.devices import cpu_with_gpu_warning, device_line, run_devices, visible_gpus
    from MaxText.parallel.distributed import initialize_distributed, select_platform
    from MaxText.train.compilation_cache import use_compilation_cache

    select_platform(config)
    initialize_distributed(config)
    try:
        use_compilation_cache(config)
        devices = run_devices(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(device_line(devices), flush=True)
        if warning := cpu_with_gpu_warning(config, devices[0].platform, visible_gpus):
            print(warning, file=sys.stderr, flush=True)
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

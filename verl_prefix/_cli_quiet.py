"""What the ``verl-prefix`` command does before verl is imported: hide verl's import-time noise.

On a machine without verl's optional engines or an accelerator, every ``import verl`` warns that five
engines are unavailable and logs that no accelerator was found. For a command line that picks its own
platform that is noise before every command. ``verl_prefix/__init__`` calls ``prepare_cli_process`` first,
and only when this process is the ``verl-prefix`` command, so library users keep verl's messages. It sits
beside the layers (stdlib only, torch at most): not in ``tools/cli.py``, which the package cannot import
early (``python -m`` would run it twice) and which the backend layer must not reach through the package.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERL_IMPORT_WARNINGS = r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available"
# where megatron-core is installed (docs/megatron.md), verl imports it, and it announces its TE/apex fallbacks
MEGATRON_IMPORT_WARNINGS = r"(Transformer Engine and Apex|Apex) (are|is) not installed"
_PLATFORM_LOGGER = "verl.plugin.platform.platform_manager"
_PLATFORM_NOISE = (
    "No supported accelerator detected",
    "Platform '%s' (%s) is registered but not available",
    "Platform override from VERL_PLATFORM",  # the CPU platform the command chose below
)


def invoked_as_cli(argv0: str | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process is the ``verl-prefix`` command (console script or ``python -m``)."""
    if argv0 is None:
        argv0 = sys.argv[0] if sys.argv else ""
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    as_module = any(a == "-m" and b == "verl_prefix.tools.cli" for a, b in zip(orig, orig[1:]))
    return os.path.basename(argv0) in ("verl-prefix", "verl-prefix.exe") or as_module


def _drop_platform_noise(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_PLATFORM_NOISE)


def hide_verl_import_warnings() -> None:
    """Drop the warnings ``import verl`` gives for each optional engine it cannot import, and megatron-core's for
    its TransformerEngine / apex fallbacks (and only those): the command line does it first thing, the demo again
    for its quiet mode."""
    warnings.filterwarnings("ignore", message=VERL_IMPORT_WARNINGS, category=UserWarning)
    warnings.filterwarnings("ignore", message=MEGATRON_IMPORT_WARNINGS, category=UserWarning)


def prepare_cli_process() -> None:
    """Filter exactly those messages, and choose verl's CPU platform before verl resolves one.

    Any other warning or log line of verl's still shows. Without CUDA the command runs verl on CPU (as
    ``tools.measure.select_platform`` does); choosing it before the import spares verl's failed
    auto-detection.
    """
    hide_verl_import_warnings()
    platform_logger = logging.getLogger(_PLATFORM_LOGGER)
    if _drop_platform_noise not in platform_logger.filters:
        platform_logger.addFilter(_drop_platform_noise)
    if "VERL_PLATFORM" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["VERL_PLATFORM"] = "cpu"
            os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")


__all__ = ["VERL_IMPORT_WARNINGS", "hide_verl_import_warnings", "invoked_as_cli", "prepare_cli_process"]

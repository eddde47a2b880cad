"""Registration with Megatron-Core: ``install()`` and the Megatron-LM launch flags.

Megatron-Core (0.15 to 0.19) picks the dispatcher with an if/elif on
``config.moe_token_dispatcher_type`` inside ``MoELayer.__init__`` and has no registry.
``install`` wraps ``MoELayer.__init__``: for type 'railwave' it runs the original constructor
with the light 'allgather' branch and the module's ``MoEAllGatherTokenDispatcher`` name pointing
at ``RailWaveTokenDispatcher`` (restored right after), then puts 'railwave' back into the config.
Nothing else in MoELayer reads the type. ``layer_spec.RailWaveMoELayer`` does the same without
patching anything, for a custom layer spec.

``moe_token_dispatcher_type='flex'`` with ``moe_flex_dispatcher_backend='railwave'`` builds the same
dispatcher (Megatron's flex dispatcher has no registry of backends either): the spelling of the
flex route, for recipes that set the backend rather than the type.

Megatron's config check (``TransformerConfig.__post_init__``) allows ``moe_shared_expert_overlap``
and ``overlap_moe_expert_parallel_comm`` only for its 'alltoall' and 'flex' dispatchers. The same
hook that gives the flag its meaning (``install``, and ``add_railwave_args`` where Megatron-Core is
already imported) runs that check for type 'railwave' as for 'alltoall' (Megatron's dispatcher-type
checks; the rest is unchanged) and puts 'railwave' back; what RailWave itself does not support is
refused by ``dispatcher.check_supported`` when the layer is built, with the reason. The same
hook refuses ``moe_enable_deepep`` with RailWave selected: Megatron would turn the flex backend
'railwave' into its own DeepEP (RailWave's exchange on DeepEP is ``backend: deepep``).

``install`` (and the layer-spec route) also refuses a CUDA machine whose compiled ops have no
CUDA kernels, unless ``RAILWAVE_OPS=reference`` asks for the pure-torch reference ops
(``check_compiled_ops``): a GPU job never runs them quietly.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
from typing import Any

from megatron_railwave.config import RailWaveConfig, load_config
from megatron_railwave.names import BACKEND_NAMES, ROUTE_CHOICES
from megatron_railwave.outputs import create_output_dir

__all__ = [
    "install",
    "uninstall",
    "installed_config",
    "add_railwave_args",
    "config_from_args",
    "check_megatron_version",
    "check_compiled_ops",
    "SUPPORTED_MEGATRON_CORE",
    "build_railwave_moe_layer",
    "wants_railwave",
]

_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}

SUPPORTED_MEGATRON_CORE = ((0, 15), (0, 19))
"""Oldest and newest Megatron-Core minor versions RailWave is tested with (both ends in CI: the
newest in ``make test``, the oldest in ``make test-mcore-oldest``)."""


def check_megatron_version(version: str | None = None) -> str:
    """Raise ``ValueError`` unless Megatron-Core's version is in ``SUPPORTED_MEGATRON_CORE``.

    Args:
        version: the version text; default the installed ``megatron.core.package_info``'s.

    Returns:
        The version checked.
    """
    from packaging.version import InvalidVersion, Version

    if version is None:
        from megatron.core import package_info

        version = str(package_info.__version__)
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_MEGATRON_CORE
    supported = f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"
    try:
        release = Version(version).release
    except InvalidVersion:
        raise ValueError(
            f"megatron-core version {version!r} is not a version RailWave can read; "
            f"supported: {supported}"
        ) from None
    if not (lo_major, lo_minor) <= tuple(release[:2]) <= (hi_major, hi_minor):
        raise ValueError(
            f"megatron-core {version} is not supported by megatron-railwave (supported: "
            f"{supported}, "
            "the dispatcher constructor takes pg_collection since 0.15); install a supported "
            "megatron-core, e.g. pip install 'megatron-core>=0.15,<0.20'"
        )
    return version


COMPILED_OPS_FIX = (
    "rebuild in this environment: TORCH_CUDA_ARCH_LIST=<your GPUs' arch, e.g. 9.0> "
    "CUDA_HOME=<CUDA toolkit, e.g. /usr/local/cuda> pip install --no-build-isolation --no-deps "
    "<railwave checkout or sdist> (README, Install), or set RAILWAVE_OPS=reference to run the "
    "pure-torch reference ops on the GPU on purpose"
)
"""The fix ``check_compiled_ops`` names."""


def check_compiled_ops() -> None:
    """Raise ``ValueError`` when CUDA is available but the compiled CUDA ops are not, unless the
    reference ops are asked for (``RAILWAVE_OPS=reference``).

    A job on GPUs without them would run the pure-torch reference ops there, much slower, with
    one warning in a log; ``install`` refuses instead, with the cause and ``COMPILED_OPS_FIX``.
    Host only (loads ``megatron_railwave._C`` once).
    """
    import torch

    from megatron_railwave import ops

    if not torch.cuda.is_available() or ops.reference_forced():
        return
    if ops.compiled_for(torch.device("cuda")):
        return
    cause = ops.load_error() or "megatron_railwave._C was built without CUDA kernels"
    raise ValueError(
        f"megatron_railwave: CUDA is available but the compiled CUDA ops are not ({cause}); "
        f"{COMPILED_OPS_FIX}"
    )


def installed_config() -> RailWaveConfig | None:
    """The active configuration, or None before ``install``."""
    return _INSTALLED.get("config")


def install(
    config: RailWaveConfig | dict | str | os.PathLike | None = None, *, stats_sink: Any = None
) -> RailWaveConfig:
    """Make ``moe_token_dispatcher_type='railwave'`` build ``RailWaveTokenDispatcher``.

    Idempotent; calling it again with a new config replaces the old one (for layers built
    afterwards).

    Args:
        config: a ``RailWaveConfig``, a dict of its fields, a YAML path, or None (defaults).
        stats_sink: optional callable receiving every layer's ``LayerCommStats``; default:
            Megatron's metrics tracker (``megatron_logging``, hooked into Megatron's per-step MoE
            report; unless ``config.metrics`` is false) plus JSONL files when ``config.log_dir``
            is set; None when neither (no statistics are computed then).

    Returns:
        The active ``RailWaveConfig``.

    Raises:
        ValueError: a bad config, a Megatron-Core outside ``SUPPORTED_MEGATRON_CORE``, or a CUDA
            machine without the compiled CUDA ops (``check_compiled_ops``).
    """
    cfg = load_config(config)
    # Fail before changing any state when Megatron-Core is missing or not a supported version.
    from megatron.core.transformer.moe import moe_layer  # noqa: F401

    check_megatron_version()
    check_compiled_ops()
    # The output directories exist before the first layer call (a path os.access accepts may
    # still not be creatable, e.g. under /proc as root).
    for name in ("log_dir", "capture_dir"):
        create_output_dir(getattr(cfg, name), name)
    with _LOCK:
        _INSTALLED["config"] = cfg
        previous = _INSTALLED.get("sink")
        if previous is not None and hasattr(previous, "close"):
            previous.close()  # flushes; a JSONL sink reopens its file if an old layer still logs
        _INSTALLED["sink"] = stats_sink if stats_sink is not None else _default_sink(cfg)
        if stats_sink is None and cfg.metrics and _tracker_available():
            # Megatron-LM's per-step MoE report also writes RailWave's scalars (megatron_logging).
            from megatron_railwave.telemetry.megatron_logging import attach_to_megatron_report

            attach_to_megatron_report()
        _patch_moe_layer()
    return cfg


def wants_railwave(config: Any) -> bool:
    """Whether a Megatron config (or parsed arguments) selects RailWave: type 'railwave', or type
    'flex' with ``moe_flex_dispatcher_backend='railwave'``."""
    kind = getattr(config, "moe_token_dispatcher_type", None)
    return kind == "railwave" or (
        kind == "flex" and getattr(config, "moe_flex_dispatcher_backend", None) == "railwave"
    )


_NOT_INSTALLED = (
    "moe_token_dispatcher_type='railwave' needs megatron_railwave.install() before the model is "
    "built: "
    "call megatron_railwave.install(config) (Megatron-LM: "
    "install(megatron_railwave.plugin.config_from_args(args)) "
    "after parsing the arguments, or set RAILWAVE_AUTO_INSTALL=1); see docs/usage.md"
)


def build_railwave_moe_layer(
    original_init: Any,
    layer: Any,
    config: Any,
    args: tuple,
    kwargs: dict,
    *,
    railwave: RailWaveConfig,
    stats_sink: Any,
) -> None:
    """Run MoELayer's constructor ``original_init`` so that it builds ``RailWaveTokenDispatcher``.

    Shared by ``install``'s wrapped constructor and ``layer_spec.RailWaveMoELayer``.
    """
    from megatron.core.transformer.moe import moe_layer

    from megatron_railwave.dispatcher import RailWaveTokenDispatcher

    factory = functools.partial(RailWaveTokenDispatcher, railwave=railwave, stats_sink=stats_sink)
    saved_type = config.moe_token_dispatcher_type
    saved = moe_layer.MoEAllGatherTokenDispatcher
    config.moe_token_dispatcher_type = "allgather"
    moe_layer.MoEAllGatherTokenDispatcher = factory
    try:
        original_init(layer, config, *args, **kwargs)
    finally:
        moe_layer.MoEAllGatherTokenDispatcher = saved
        config.moe_token_dispatcher_type = saved_type
    dispatcher = layer.token_dispatcher
    dispatcher.layer_number = getattr(layer, "layer_number", None)
    dispatcher.set_moe_layer(layer)


def _patch_moe_layer() -> None:
    """Wrap ``MoELayer.__init__`` / ``set_layer_number`` once (caller holds ``_LOCK``).

    The wrapped constructor builds ``RailWaveTokenDispatcher`` for type 'railwave' with the
    installed config, and raises a clear error naming ``install()`` when there is none (instead
    of Megatron's "Unsupported token dispatcher type").
    """
    from megatron.core.transformer.moe import moe_layer

    if "original_init" in _INSTALLED:
        return
    _patch_config_check()
    original_init = moe_layer.MoELayer.__init__
    original_set_layer = moe_layer.MoELayer.set_layer_number

    @functools.wraps(original_init)
    def init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if not wants_railwave(config):
            return original_init(self, config, *args, **kwargs)
        rw = _INSTALLED.get("config")
        if rw is None:
            raise ValueError(_NOT_INSTALLED)
        build_railwave_moe_layer(
            original_init, self, config, args, kwargs, railwave=rw, stats_sink=_INSTALLED["sink"]
        )

    @functools.wraps(original_set_layer)
    def set_layer_number(self: Any, layer_number: int) -> None:
        original_set_layer(self, layer_number)
        dispatcher = getattr(self, "token_dispatcher", None)
        if dispatcher is not None and hasattr(dispatcher, "railwave"):
            dispatcher.layer_number = layer_number

    moe_layer.MoELayer.__init__ = init
    moe_layer.MoELayer.set_layer_number = set_layer_number
    _INSTALLED["original_init"] = original_init
    _INSTALLED["original_set_layer"] = original_set_layer


def _patch_config_check() -> None:
    """Wrap ``TransformerConfig.__post_init__`` once (caller holds ``_LOCK``; see the module
    docstring): for type 'railwave', Megatron's checks run as for 'alltoall'."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "original_post_init" in _INSTALLED:
        return
    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def post_init(self: Any) -> None:
        if wants_railwave(self) and getattr(self, "moe_enable_deepep", False):
            # Megatron would turn the flex backend into its own DeepEP ('railwave' quietly
            # replaced) or refuse type 'railwave' as "not flex".
            raise ValueError(_ENABLE_DEEPEP)
        if getattr(self, "moe_token_dispatcher_type", None) != "railwave":
            return original(self)
        self.moe_token_dispatcher_type = "alltoall"
        try:
            original(self)
        finally:
            self.moe_token_dispatcher_type = "railwave"

    TransformerConfig.__post_init__ = post_init
    _INSTALLED["original_post_init"] = original


_ENABLE_DEEPEP = (
    "moe_enable_deepep=True (--moe-enable-deepep) selects Megatron's own DeepEP flex dispatcher, "
    "which would replace RailWave; drop it, and for RailWave's exchange on DeepEP set the railwave "
    "config's backend: deepep (--railwave-backend deepep; docs/usage.md, Flags)"
)


def uninstall() -> None:
    """Undo ``install`` (tests)."""
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_railwave.telemetry.megatron_logging import detach_from_megatron_report

    with _LOCK:
        if "original_post_init" in _INSTALLED:
            TransformerConfig.__post_init__ = _INSTALLED.pop("original_post_init")
        if "original_init" in _INSTALLED:
            moe_layer.MoELayer.__init__ = _INSTALLED.pop("original_init")
            moe_layer.MoELayer.set_layer_number = _INSTALLED.pop("original_set_layer")
        sink = _INSTALLED.get("sink")
        if sink is not None and hasattr(sink, "close"):
            sink.close()
        detach_from_megatron_report()
        _INSTALLED.clear()


def _tracker_available() -> bool:
    """Whether this Megatron-Core has ``MoEMetricsTracker`` (``moe_logging``; not in 0.15)."""
    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker  # noqa: F401
    except ImportError:
        return False
    return True


def _default_sink(cfg: RailWaveConfig) -> Any:
    """Megatron's tracker sink (``megatron_logging``) unless ``metrics`` is off or this
    Megatron-Core has no tracker, plus JSONL files when ``log_dir`` is set; None when neither."""
    from megatron_railwave.telemetry.commlog import FanoutSink, JsonlStatsSink

    sinks: list[Any] = []
    if cfg.metrics and _tracker_available():
        from megatron_railwave.telemetry.megatron_logging import default_metrics_sink

        sinks.append(default_metrics_sink())
    if cfg.log_dir is not None:
        sinks.append(JsonlStatsSink(cfg.log_dir, interval=cfg.log_interval, mode=cfg.log_mode))
    return FanoutSink(*sinks) if sinks else None


# ---------------------------------------------------------------------- Megatron-LM flags
def add_railwave_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Extend a Megatron-LM parser (usable as ``extra_args_provider``).

    Adds 'railwave' to ``--moe-token-dispatcher-type`` choices and the RailWave flags. When
    Megatron-Core is already imported (Megatron-LM's argument parsing imports it) it also hooks
    ``MoELayer`` without installing anything, so that a model built with type 'railwave' before
    ``install()`` fails with a message that says to call ``install()`` instead of Megatron's
    "Unsupported token dispatcher type". Megatron is not imported here: on a CPU-only torch its
    first import must come after the CPU shims.
    """
    if "megatron.core" in sys.modules:
        try:
            with _LOCK:
                _patch_moe_layer()
        except ImportError:  # a Megatron-Core without the MoE package: only the flags
            pass
    for (
        action
    ) in parser._actions:  # the flex route's spelling: --moe-flex-dispatcher-backend railwave
        if "--moe-flex-dispatcher-backend" in action.option_strings:
            if action.choices is not None and "railwave" not in action.choices:
                action.choices = list(action.choices) + ["railwave"]
    for action in parser._actions:  # argparse keeps choices on the action; extend in place
        if "--moe-token-dispatcher-type" in action.option_strings:
            if action.choices is not None and "railwave" not in action.choices:
                action.choices = list(action.choices) + ["railwave"]
            break
    else:
        parser.add_argument(
            "--moe-token-dispatcher-type",
            type=str,
            default="allgather",
            choices=["allgather", "alltoall", "flex", "railwave"],
        )
    group = parser.add_argument_group(title="railwave")
    group.add_argument(
        "--railwave-config",
        type=str,
        default=None,
        help="RailWave YAML config, or the name of a packaged example (glm45_air_h800).",
    )
    group.add_argument(
        "--railwave-path",
        type=str,
        default=None,
        choices=list(ROUTE_CHOICES),
        help="Execution path; overrides the config file's 'path'.",
    )
    group.add_argument(
        "--railwave-log-dir",
        type=str,
        default=None,
        help="Write per-layer communication JSONL here.",
    )
    group.add_argument(
        "--railwave-log-mode",
        type=str,
        default=None,
        choices=["rank", "job"],
        help="JSONL layout: one file per rank, or one per job written by rank 0.",
    )
    group.add_argument(
        "--railwave-capture-dir",
        type=str,
        default=None,
        help="Record routing traces for replay here.",
    )
    group.add_argument(
        "--railwave-capture-interval",
        type=int,
        default=None,
        help="Record a trace every this many steps.",
    )
    group.add_argument(
        "--railwave-no-metrics",
        action="store_true",
        default=None,
        help="Do not report railwave_* scalars through Megatron's MoE metrics tracker.",
    )
    group.add_argument(
        "--railwave-backend",
        type=str,
        default=None,
        choices=list(BACKEND_NAMES),
        help="Execution backend; overrides the config file's 'backend' (docs/deepep.md).",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> RailWaveConfig:
    """The ``RailWaveConfig`` that parsed Megatron-LM arguments describe."""
    base = load_config(getattr(args, "railwave_config", None)).to_dict()
    for flag, key in (
        ("railwave_path", "path"),
        ("railwave_log_dir", "log_dir"),
        ("railwave_log_mode", "log_mode"),
        ("railwave_capture_dir", "capture_dir"),
        ("railwave_capture_interval", "capture_interval"),
        ("railwave_backend", "backend"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            base[key] = value
    if getattr(args, "railwave_no_metrics", None):
        base["metrics"] = False
    return RailWaveConfig.from_dict(base)

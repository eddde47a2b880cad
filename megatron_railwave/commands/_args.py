"""The ``railwave`` commands' shared flags and argument groups, each defined here once.

A flag that more than one command takes (``--tokens``, ``--cluster``, ``--json``, ...) has one
spelling, metavar, type and help text here; a command passes its own default, and ``add_flag``
writes that default into the help. The groups (cluster, cluster shape, workload, planner,
measurement, output, progress) are those flags in the order the commands list them.

The output flags mean one thing in every command (``add_output_args``; each is declared with
``_outputs``, so ``railwave`` checks it before the command does any work):
  * ``--json FILE``: a JSON file (strict JSON, ``_common.write_json``);
  * ``--out DIR``: a directory the command writes its files into;
  * ``--plot PNG``: one image; ``--write-model YAML``: the netmodel config the command writes
    (``--out`` named that file before; it still works for one release, with a warning).

Letters: N nodes, G GPUs per node, T tokens per rank, E experts, K top-k, H hidden size.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from megatron_railwave.commands import _outputs
from megatron_railwave.lab.workloads import Pattern
from megatron_railwave.names import parse_route, route_list

__all__ = [
    "ARRANGEMENTS",
    "DELIVERIES",
    "Container",
    "add_cluster_args",
    "add_flag",
    "add_measure_args",
    "add_output_args",
    "add_output_file",
    "add_plan_args",
    "add_progress_arg",
    "add_renamed_flag",
    "add_shape_args",
    "add_workload_args",
    "comma_choices",
    "comma_floats",
    "comma_ints",
    "layer_count_or_list",
    "parse_failed_rail",
    "parse_path_choice",
    "parse_payload_scale",
]

Container = argparse.ArgumentParser | argparse._ArgumentGroup
"""Where a flag goes: a parser or one of its argument groups."""

ARRANGEMENTS = ("none", *map(str, Pattern))
"""Sending arrangements of the replay workloads: ``none`` (every node pair at once, as a training
step sends) and the paper's windows (``workloads.Pattern``: ring, moderate, extreme)."""

DELIVERIES = ("after_rail", "streamed")
"""The flow model's stage-3 delivery (``NetModelConfig.delivery``)."""


# ---------------------------------------------------------------------------- argparse types
def parse_failed_rail(text: str) -> tuple[int, int]:
    """argparse type of ``--failed-rail NODE:RAIL`` (range is checked by the topology)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected NODE:RAIL with two integers (e.g. 0:3), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def parse_path_choice(text: str) -> str:
    """argparse type of ``--path``: a path name (paper aliases accepted) or 'all'."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return str(parse_route(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown path {text!r}; choose one of {route_list(extra=('all',))}"
        ) from None


def parse_payload_scale(text: str) -> float:
    """argparse type of ``--payload-scale``: a positive number, or 'paper'
    (``workloads.PAPER_PAYLOAD_SCALE``)."""
    from megatron_railwave.lab.workloads import PAPER_PAYLOAD_SCALE

    if text.strip().lower() == "paper":
        return PAPER_PAYLOAD_SCALE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'paper', got {text!r}")
    return value


def comma_choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: some of ``allowed`` separated by commas (lower-cased)."""

    def parse(text: str) -> list[str]:
        values = [v.strip().lower() for v in text.split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(
                f"expected some of {','.join(allowed)} separated by commas, got {text!r}"
            )
        return values

    return parse


def comma_ints(
    what: str, *, minimum: int | None = None, allow_empty: bool = False
) -> Callable[[str], list[int]]:
    """argparse type: integers (each >= ``minimum``) separated by commas; ``what`` names them in
    the error (e.g. "positive integers")."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = None
        if (
            values is None
            or (not values and not allow_empty)
            or (minimum is not None and any(v < minimum for v in values))
        ):
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}")
        return values

    return parse


def comma_floats(what: str, *, minimum: float, inclusive: bool) -> Callable[[str], list[float]]:
    """argparse type: numbers separated by commas, each > ``minimum`` (>= with ``inclusive``);
    ``what`` names them in the error."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or not all(v >= minimum if inclusive else v > minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}")
        return values

    return parse


def layer_count_or_list(text: str) -> list[int]:
    """argparse type of ``--layers K|L,L``: one number K = the first K MoE layers (returned as
    ``[-K]``), or a list of layer numbers (``_common.glm_layers`` resolves both)."""
    values = comma_ints("positive integers", minimum=1)(text)
    return values if "," in text else [-values[0]]


def _rail_mask_gpus(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of local GPU indices (e.g. 0,1,2,3), got {text!r}"
        ) from None


# ---------------------------------------------------------------------------- the shared flags
_FLAGS: dict[str, dict[str, Any]] = {
    # cluster
    "--cluster": {
        "metavar": "YAML",
        "help": "cluster YAML file, or the name of a packaged preset (e.g. h800_4x8)",
    },
    "--nodes": {"type": int, "metavar": "N", "help": "nodes"},
    "--gpus-per-node": {"type": int, "metavar": "G", "help": "GPUs per node"},
    "--failed-rail": {
        "type": parse_failed_rail,
        "action": "append",
        "metavar": "NODE:RAIL",
        "help": "mark rail RAIL of node NODE failed (repeatable)",
    },
    # workload
    "--workload": {"choices": ("glm45-air",), "help": "routing generator"},
    "--steps": {"type": int, "help": "training steps"},
    "--tokens": {"type": int, "metavar": "T", "help": "tokens per GPU"},
    "--experts": {"type": int, "metavar": "E", "help": "routed experts"},
    "--topk": {"type": int, "metavar": "K", "help": "experts per token"},
    "--hidden": {"type": int, "metavar": "H", "help": "hidden size"},
    "--dtype": {"help": "payload element type"},
    "--seed": {"type": int, "help": "routing seed"},
    "--layers": {
        "type": comma_ints("layer numbers", allow_empty=True),
        "metavar": "L,L",
        "help": "MoE layer numbers",
    },
    "--pattern": {
        "type": comma_choices(ARRANGEMENTS),
        "metavar": "P,P",
        "help": "arrangements: none (all node pairs at once), ring, moderate, extreme",
    },
    "--payload-scale": {
        "type": parse_payload_scale,
        "metavar": "X|paper",
        "help": "multiply every record count; 'paper': workloads.PAPER_PAYLOAD_SCALE (1.895: the "
        "paper's layer times, NATIVE RING on H800)",
    },
    # planner
    "--path": {"type": parse_path_choice, "metavar": "PATH", "help": route_list(extra=("all",))},
    "--fanin": {
        "type": int,
        "metavar": "F",
        "help": "remote senders per receiver per wave for perm/joint",
    },
    "--chunks": {"type": int, "metavar": "C", "help": "rail chunks per wave for perm/joint"},
    # flow model
    "--model": {
        "metavar": "YAML",
        "help": "netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8)",
    },
    "--path-delivery": {
        "choices": DELIVERIES,
        "help": "stage 3 of RailWave's paths: after_rail (store and forward, as the exchange "
        "runs) or streamed (as DeepEP's forwarders)",
    },
    "--peers": {"metavar": "P,P", "help": "peers on the same demand and model"},
    "--alpha": {"type": float, "help": "incast alpha"},
    # measurement
    "--backend": {"choices": ("netmodel",), "help": "what times the paths"},
    "--warmups": {"type": int, "help": "untimed calls"},
    "--repeats": {"type": int, "help": "timed repeats"},
    "--samples": {"type": int, "help": "timed rounds"},
    "--timeout": {"type": float, "metavar": "S", "help": "limit in seconds"},
    "--device": {"choices": ("cpu", "cuda"), "help": "where to run"},
}


def add_flag(
    container: Container,
    flag: str,
    default: Any = None,
    *,
    help: str | None = None,
    default_text: str | None = None,
    **overrides: Any,
) -> argparse.Action:
    """Add ``flag`` with this command's ``default``: a shared flag (``_FLAGS``) with its spelling,
    metavar, type and help; a flag of one command with the keywords given here.

    ``help`` replaces the flag's help text; the default is appended as "(default X)" unless it is
    None or False (``default_text`` overrides the shown text: e.g. the default a None stands for).
    ``overrides`` replace the flag's argparse keywords (``type``, ``choices``, ``required``, ...).
    """
    spec = {**_FLAGS.get(flag, {}), **overrides}
    text = help if help is not None else spec.pop("help")
    spec.pop("help", None)
    shown = default_text if default_text is not None else _shown(default)
    if shown is not None and not spec.get("required"):
        text = f"{text} (default {shown})"
    if spec.get("action") == "append" and default is None:
        default = []
    return container.add_argument(flag, default=default, help=text, **spec)


def _shown(default: Any) -> str | None:
    if default is None or default is False or default == []:
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default))
    return f"{default:g}" if isinstance(default, float) else str(default)


def _group(container: Container, title: str) -> Container:
    """A new argument group of a parser; an existing group as it is."""
    if isinstance(container, argparse.ArgumentParser):
        return container.add_argument_group(title)
    return container


# ---------------------------------------------------------------------------- the groups
def add_cluster_args(
    container: Container, *, default: str | None = None, overrides: bool = True
) -> None:
    """``--cluster YAML`` (required without a ``default``); with ``overrides`` also ``--nodes N``
    and ``--failed-rail NODE:RAIL`` applied on top of it (``_common.cluster_from_args``)."""
    group = _group(container, "cluster")
    add_flag(group, "--cluster", default, required=default is None)
    if overrides:
        add_flag(group, "--nodes", help="override the node count of the cluster file")
        add_flag(group, "--failed-rail")


def add_shape_args(
    container: Container,
    *,
    nodes: int | None,
    gpus_per_node: int | None,
    gpus_help: str = "GPUs per node",
    failed_rail: bool = False,
    unset_default: bool = False,
) -> None:
    """A cluster given by its shape, ``--nodes N --gpus-per-node G`` (no cluster file), and
    ``--failed-rail`` when the command can fail rails. ``unset_default``: the flags default to
    None (the command's spec fills them in) and the help shows ``nodes`` / ``gpus_per_node``."""
    group = _group(container, "cluster")
    for flag, value, text in (
        ("--nodes", nodes, "nodes"),
        ("--gpus-per-node", gpus_per_node, gpus_help),
    ):
        if unset_default:
            add_flag(group, flag, None, help=text, default_text=str(value))
        else:
            add_flag(group, flag, value, help=text)
    if failed_rail:
        add_flag(group, "--failed-rail")


def add_workload_args(
    container: Container,
    *,
    tokens: int | None = None,
    experts: int | None = None,
    topk: int | None = None,
    hidden: int | None = None,
    dtype: str | None = None,
    seed: int | None = 0,
    per: str = "GPU",
    experts_help: str = "routed experts",
    dtypes: Sequence[str] | None = None,
    seed_help: str = "routing seed",
    unset_default: bool = False,
) -> None:
    """The workload flags this command takes (a None default leaves the flag out): ``--tokens``
    per ``per``, ``--experts``, ``--topk``, ``--hidden``, ``--dtype`` (``dtypes``: its choices;
    None: any name ``traffic.dtype_bytes`` knows) and ``--seed``. ``unset_default``: every flag
    defaults to None (the command's spec fills it in) and the help shows the given value."""
    group = _group(container, "workload")
    flags = (
        ("--tokens", tokens, f"tokens per {per}"),
        ("--experts", experts, experts_help),
        ("--topk", topk, None),
        ("--hidden", hidden, None),
    )
    for flag, value, text in flags:
        if value is None:
            continue
        if unset_default:
            add_flag(group, flag, None, help=text, default_text=str(value))
        else:
            add_flag(group, flag, value, help=text)
    if dtype is not None:
        choices = {"choices": list(dtypes)} if dtypes else {}
        add_flag(
            group,
            "--dtype",
            dtype,
            help=f"payload element type{'' if dtypes else ': bf16, fp16, fp32, fp8'}",
            **choices,
        )
    if seed is not None:
        add_flag(group, "--seed", seed, help=seed_help)


def add_plan_args(container: Container, *, default_path: str = "joint") -> None:
    """The planner's options (``_common.options_from_args``): ``--path``, ``--policy``,
    ``--rail-mask``, ``--fanin``, ``--chunks``, ``--phase``."""
    from megatron_railwave.planner import EligiblePolicy

    group = _group(container, "planner")
    add_flag(group, "--path", default_path)
    group.add_argument(
        "--policy",
        choices=[str(p) for p in EligiblePolicy],
        default="all",
        help="RailBalance eligible rails: all healthy, active senders, or --rail-mask",
    )
    group.add_argument(
        "--rail-mask",
        type=_rail_mask_gpus,
        default=None,
        metavar="GPUS",
        help="local GPUs (rails) allowed under --policy mask on every node, e.g. 0,1,2,3",
    )
    add_flag(group, "--fanin", 1, default_text="1: cyclic")
    add_flag(group, "--chunks", 1, default_text="1: whole waves")
    group.add_argument(
        "--phase", type=int, default=0, help="remainder-rotation counter (default 0)"
    )


def add_measure_args(
    container: Container,
    *,
    warmups: int,
    repeats: int | None,
    warmups_help: str,
    repeats_help: str = "",
    renamed_warmup: bool = False,
) -> Container:
    """``--warmups`` and ``--repeats`` (None: left out) in a "measurement" group (returned, for
    the command's own measurement flags). ``renamed_warmup``: the command spelled ``--warmups``
    ``--warmup`` before (``add_renamed_flag``)."""
    group = _group(container, "measurement")
    action = add_flag(group, "--warmups", warmups, help=warmups_help)
    if renamed_warmup:
        add_renamed_flag(group, "--warmup", action, reason="one spelling in every railwave command")
    if repeats is not None:
        add_flag(group, "--repeats", repeats, help=repeats_help)
    return group


def add_progress_arg(container: Container) -> None:
    """``--no-progress``: no progress bar (tqdm)."""
    container.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------- outputs
def add_output_args(
    container: Container,
    *,
    json: str | None = None,
    plot: str | None = None,
    out: str | None = None,
) -> Container:
    """The output group: ``--json FILE`` (``json``: what is written, e.g. "the plan(s)"),
    ``--plot PNG`` (``plot``: what it shows) and ``--out DIR`` (``out``: its help, with the
    default); each declared with ``_outputs``. Returns the group, for the command's other
    outputs (``add_output_file``)."""
    group = _group(container, "output")
    if json is not None:
        add_output_file(group, "--json", metavar="FILE", help=f"write {json} as JSON")
    if plot is not None:
        add_output_file(group, "--plot", metavar="PNG", help=plot)
    if out is not None:
        group.add_argument("--out", default=None, metavar="DIR", help=out)
        _outputs.declare_outputs(group, dirs=("out",))
    return group


def add_output_file(
    container: Container,
    flag: str,
    *,
    metavar: str,
    help: str,
    required: bool = False,
    renamed_from: str | None = None,
) -> None:
    """A flag naming a file the command writes, declared with ``_outputs``.

    ``renamed_from``: the flag's old spelling, ``--out`` (which names a directory now), still
    accepted for one release (``add_renamed_flag``); the two exclude each other, and with
    ``required`` one of them is required.
    """
    target: Container = container
    if renamed_from is not None:
        target = container.add_mutually_exclusive_group(required=required)
        required = False
    action = target.add_argument(flag, default=None, metavar=metavar, help=help, required=required)
    if renamed_from is not None:
        add_renamed_flag(
            target, renamed_from, action, reason="--out names a directory in every railwave command"
        )
    _outputs.declare_outputs(container, files=(action.dest,))


def add_renamed_flag(container: Container, old: str, new: argparse.Action, *, reason: str) -> None:
    """``old``, the former spelling of the flag ``new``, accepted for one release: left out of
    the help, it stores into ``new``'s argument (with ``new``'s type) and prints a warning that
    names ``new`` and the ``reason`` for the change."""
    container.add_argument(
        old,
        dest=new.dest,
        type=new.type,
        metavar=new.metavar,
        default=argparse.SUPPRESS,
        action=_RenamedFlag,
        new_flag=new.option_strings[0],
        reason=reason,
        help=argparse.SUPPRESS,
    )


class _RenamedFlag(argparse.Action):
    """The old spelling of a renamed flag: stores into the new flag's argument and warns."""

    def __init__(
        self, option_strings: list[str], dest: str, *, new_flag: str, reason: str, **kwargs: Any
    ):
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} {values} is deprecated and will be removed "
            f"in the next release: use {self.new_flag} {values} ({self.reason})",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)

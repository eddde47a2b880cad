"""The railwave CLI: frozen subcommand and flag set, JSON of `plan` and `plan-bench`, clear
errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_railwave.cli import build_parser, main
from megatron_railwave.names import ROUTES

H800 = str(
    Path(__file__).resolve().parents[2]
    / "megatron_railwave"
    / "configs"
    / "clusters"
    / "h800_4x8.yaml"
)

# Adding a command or a flag is a deliberate interface change: update this table with it.
EXPECTED_FLAGS = {
    "plan": [
        "--cluster",
        "--nodes",
        "--failed-rail",
        "--tokens",
        "--experts",
        "--topk",
        "--hidden",
        "--dtype",
        "--seed",
        "--path",
        "--policy",
        "--rail-mask",
        "--fanin",
        "--chunks",
        "--phase",
        "--repeats",
        "--json",
    ],
    "plan-bench": [
        "--configs",
        "--tokens",
        "--experts",
        "--topk",
        "--path",
        "--fanin",
        "--seed",
        "--warmups",
        "--repeats",
        "--full-routing-max-ranks",
        "--json",
    ],
    "demo": ["--seed", "--tokens", "--json"],
    "bench-exchange": [
        "--nodes",
        "--gpus-per-node",
        "--failed-rail",
        "--tokens",
        "--hidden",
        "--experts",
        "--topk",
        "--dtype",
        "--seed",
        "--path",
        "--warmups",
        "--samples",
        "--backward",
        "--no-alltoall",
        "--timeout",
        "--profile",
        "--profile-out",
        "--shared-expert",
        "--shared-ffn",
        "--json",
    ],
    "online-sim": [
        "--cluster",
        "--nodes",
        "--failed-rail",
        "--model",
        "--workload",
        "--tokens",
        "--layers",
        "--workload-seed",
        "--steps",
        "--routing-every",
        "--seed",
        "--noise",
        "--streamed",
        "--candidates",
        "--chunks",
        "--learned",
        "--base-from",
        "--decision-cost",
        "--json",
    ],
    "call-costs": [
        "--nodes",
        "--gpus-per-node",
        "--tokens",
        "--hidden",
        "--experts",
        "--topk",
        "--seed",
        "--warmups",
        "--samples",
        "--no-virtual",
        "--timeout",
        "--json",
    ],
    "probe-incast": [
        "--torchrun",
        "--local",
        "--gpus-per-node",
        "--nbytes",
        "--max-senders",
        "--port-gbps",
        "--repeats",
        "--warmups",
        "--timeout",
        "--json",
        "--write-model",
        "--base-model",
    ],
    "report": ["--out", "--no-plots", "--json", "--run"],
    "ops-bench": [
        "--device",
        "--quick",
        "--tokens",
        "--hidden",
        "--experts",
        "--topk",
        "--nodes",
        "--gpus-per-node",
        "--repeats",
        "--seed",
        "--json",
    ],
    "testbed": [],
    "netmodel": [],
    "workloads": [],
    "simulate-exchange": [
        "--expect-host-syncs",
        "--require-compiled",
        "--cluster",
        "--nodes",
        "--failed-rail",
        "--tokens",
        "--hidden",
        "--experts",
        "--topk",
        "--dtype",
        "--device",
        "--seed",
        "--max-tokens-per-rank",
        "--chunks",
        "--max-error",
        "--max-memory-gib",
        "--json",
    ],
    "doctor": ["--config", "--no-self-test", "--json"],
    "bench": [
        "--cluster",
        "--nodes",
        "--failed-rail",
        "--backend",
        "--model",
        "--alpha",
        "--workload",
        "--pattern",
        "--layers",
        "--steps",
        "--tokens",
        "--payload-scale",
        "--seed",
        "--paths",
        "--fanin",
        "--chunks",
        "--streamed",
        "--peers",
        "--path-delivery",
        "--plan-repeats",
        "--json",
        "--plot",
        "--no-progress",
    ],
    "sensitivity": [
        "--cluster",
        "--nodes",
        "--failed-rail",
        "--model",
        "--alpha",
        "--skews",
        "--pattern",
        "--seeds",
        "--layers",
        "--tokens",
        "--payload-scale",
        "--path-delivery",
        "--chunks",
        "--streamed",
        "--peers",
        "--incast-layers",
        "--no-incast-prediction",
        "--json",
        "--plot",
        "--no-progress",
    ],
    # The actions of the commands with actions.
    "testbed up": [
        "--nodes",
        "--gpus-per-node",
        "--rail-mbit",
        "--mtu",
        "--port-buffer-bytes",
        "--rto-min-ms",
        "--sender-queue-bytes",
        "--prefix",
        "--state-dir",
    ],
    "testbed down": ["--state-dir"],
    "testbed run": [
        "--name",
        "--state-dir",
        "--nodes",
        "--gpus-per-node",
        "--rail-mbit",
        "--mtu",
        "--port-buffer-bytes",
        "--rto-min-ms",
        "--sender-queue-bytes",
        "--prefix",
        "--patterns",
        "--rails",
        "--paths",
        "--tokens",
        "--hidden",
        "--dtype",
        "--seed",
        "--balanced-layer",
        "--skewed-layer",
        "--arrange-mode",
        "--warmups",
        "--samples",
        "--no-recv-first",
        "--fault",
        "--fail-rail",
        "--exchange-timeout-s",
        "--incast",
        "--json",
    ],
    "testbed online": [
        "--name",
        "--state-dir",
        "--nodes",
        "--gpus-per-node",
        "--rail-mbit",
        "--mtu",
        "--port-buffer-bytes",
        "--rto-min-ms",
        "--sender-queue-bytes",
        "--prefix",
        "--patterns",
        "--rails",
        "--paths",
        "--steps",
        "--tokens",
        "--hidden",
        "--dtype",
        "--seed",
        "--warmups",
        "--timeout",
        "--json",
    ],
    "netmodel fit-incast": [
        "--cluster",
        "--tokens",
        "--seed",
        "--delivery",
        "--k-sat",
        "--max-alpha",
        "--write-model",
    ],
    "netmodel bench-engine": [
        "--nodes",
        "--gpus-per-node",
        "--sizes",
        "--rel-tol",
        "--alpha",
        "--json",
    ],
    "workloads fit": [
        "--cluster",
        "--seed",
        "--steps",
        "--nic-steps",
        "--sampled-steps",
        "--tokens",
        "--refit",
        "--fit-steps",
        "--sweeps",
        "--json",
    ],
    "workloads token-skew": ["--json"],
}


DEPRECATED_FLAGS = {
    "netmodel fit-incast": {"--out": "--write-model"},
    "plan-bench": {"--warmup": "--warmups"},
    "testbed run": {"--warmup": "--warmups"},
    "testbed online": {"--warmup": "--warmups"},
}
"""Old spellings still accepted for one release (hidden from the help): old -> new flag."""


def _subcommands(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _subcommands(sub, f"{prefix}{name} ")


def _flag_table(parser: argparse.ArgumentParser, *, hidden: bool = False) -> dict[str, list[str]]:
    """Per (sub)command its flags shown in the help (``hidden``: those left out of it)."""
    return {
        name: [
            s
            for a in p._actions
            if (a.help == argparse.SUPPRESS) == hidden
            for s in a.option_strings
            if s.startswith("--") and s != "--help"
        ]
        for name, p in _subcommands(parser)
    }


def test_cli_subcommands_and_flags_snapshot():
    table = _flag_table(build_parser())
    assert sorted(table) == sorted(EXPECTED_FLAGS), (
        f"subcommands changed: {sorted(table)}; update EXPECTED_FLAGS in {__file__} with the new "
        f"command's flags"
    )
    for name, flags in EXPECTED_FLAGS.items():
        assert sorted(table[name]) == sorted(flags), (
            f"flags of {name!r} changed: update EXPECTED_FLAGS in {__file__}"
        )
    hidden = {
        name: flags for name, flags in _flag_table(build_parser(), hidden=True).items() if flags
    }
    assert hidden == {name: list(old) for name, old in DEPRECATED_FLAGS.items()}


def test_version_prints_the_package_version(capsys):
    from megatron_railwave import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"railwave {__version__}\n"


def test_help_lists_user_commands_first_and_lab_commands_under_their_own_heading(capsys):
    from megatron_railwave.cli import LAB_COMMANDS, USER_COMMANDS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    user_at, lab_at = out.index("\nuser commands:\n"), out.index("\nlab commands:\n")
    assert user_at < lab_at
    listed = [
        line.split()[0] for line in out.splitlines() if line.startswith("  ") and line[2] != " "
    ]
    names = [m.rsplit(".", 1)[1].replace("_", "-") for m in USER_COMMANDS + LAB_COMMANDS]
    listed = [n for n in listed if n in names]
    assert listed == names  # every command once, in its section's order
    for module in USER_COMMANDS:
        assert out.index(f"\n  {module.rsplit('.', 1)[1].replace('_', '-')} ") < lab_at
    for module in LAB_COMMANDS:
        assert out.index(f"\n  {module.rsplit('.', 1)[1].replace('_', '-')} ") > lab_at
    assert {"doctor", "report", "plan"} <= {m.rsplit(".", 1)[1] for m in USER_COMMANDS}
    assert "--version" in out and "COMMAND" in out.splitlines()[0]


def test_json_is_a_file_and_out_a_directory_in_every_command():
    # --json FILE names a file (declared as an output file) and --out DIR a directory (declared
    # as an output directory), wherever a command has them.
    for name, parser in _all_parsers(build_parser()):
        files = set(parser.get_default("output_files") or ())
        dirs = set(parser.get_default("output_dirs") or ())
        for action in parser._actions:
            if "--json" in action.option_strings:
                assert action.dest in files and action.metavar == "FILE", name
            if "--out" in action.option_strings and action.help != argparse.SUPPRESS:
                assert action.dest in dirs and action.metavar == "DIR", name


@pytest.mark.parametrize(
    ("argv", "new", "dest", "value"),
    [
        (["netmodel", "fit-incast", "--out", "m.yaml"], "--write-model", "write_model", "m.yaml"),
        (["plan-bench", "--warmup", "0"], "--warmups", "warmups", 0),
        (["testbed", "run", "--warmup", "1"], "--warmups", "warmups", 1),
        (["testbed", "online", "--warmup", "1"], "--warmups", "warmups", 1),
    ],
)
def test_a_renamed_flag_still_works_for_one_release_and_names_the_new_one(
    capsys, argv, new, dest, value
):
    args = build_parser().parse_args(argv)
    old = argv[-2]
    assert getattr(args, dest) == value and not hasattr(args, old.lstrip("-"))
    err = capsys.readouterr().err
    assert f"{old} {argv[-1]} is deprecated" in err and f"use {new} {argv[-1]}" in err


def test_retired_selector_commands_are_gone(capsys):
    # calibrate / validate wrote and checked the offline anchors files, retired with them.
    for name in ("calibrate", "validate"):
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_arrangements_are_the_workload_patterns():
    from megatron_railwave.commands._args import ARRANGEMENTS
    from megatron_railwave.lab.workloads import Pattern

    assert ARRANGEMENTS == ("none", "ring", "moderate", "extreme") == ("none", *map(str, Pattern))


def test_plan_writes_json_with_required_keys(tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = main(
        [
            "plan",
            "--cluster",
            H800,
            "--tokens",
            "64",
            "--experts",
            "32",
            "--topk",
            "4",
            "--seed",
            "1",
            "--path",
            "joint",
            "--failed-rail",
            "2:5",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    data = json.loads(out.read_text())
    assert {"rail_load", "waves", "records_total", "stats", "plan_ms"} <= set(data)
    assert data["path"] == "joint"
    rail_load = data["rail_load"]
    assert (len(rail_load), len(rail_load[0]), len(rail_load[0][0])) == (4, 8, 4)  # [N][R][N]
    assert rail_load[2][5][0] == 0  # the failed rail carries nothing remote
    # cyclic schedule on 4 nodes: 3 waves of 4 [src, dst] pairs
    assert [len(w) for w in data["waves"]] == [4, 4, 4] and data["waves"][0][0] == [0, 1]
    assert data["records_total"] == sum(sum(sum(r) for r in node) for node in rail_load)
    assert {"B_mean_bytes", "B_max_bytes", "rho_g", "kappa"} <= set(data["stats"])
    assert data["stats"]["kappa"] == pytest.approx(1.0) and data["plan_ms"] > 0
    assert "joint" in capsys.readouterr().out


def test_plan_all_paths_native_is_skewed(tmp_path):
    out = tmp_path / "all.json"
    assert (
        main(
            [
                "plan",
                "--cluster",
                "h800_4x8",
                "--tokens",
                "256",
                "--experts",
                "32",
                "--path",
                "all",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plans = {p["path"]: p for p in json.loads(out.read_text())["plans"]}
    assert list(plans) == list(map(str, ROUTES))
    assert plans["native"]["stats"]["rho_g"] > 1.2  # skewed source rails under NATIVE
    assert plans["rail"]["stats"]["rho_g"] < plans["native"]["stats"]["rho_g"]
    assert plans["perm"]["stats"]["kappa"] == pytest.approx(1.0)
    assert plans["native"]["stats"]["kappa"] > 1.5  # three senders per receiver at once


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--path", "ring"],
            r"argument --path: unknown path 'ring'; choose one of native, rail, perm, joint, flow, "
            r"flow-waves, all",
        ),
        (
            ["--failed-rail", "0:9"],
            r"--failed-rail: failed rail \(0, 9\): rail 9 is out of range 0\.\.7",
        ),
        (["--failed-rail", "7:0"], r"node 7 is out of range 0\.\.3"),
        (["--failed-rail", "0-3"], r"argument --failed-rail: expected NODE:RAIL with two integers"),
        (["--policy", "mask"], r"--policy mask needs --rail-mask GPUS"),
        (["--experts", "48"], r"--experts 48 is not divisible by the world size 32"),
        (["--dtype", "int3"], r"unknown dtype name 'int3'"),
    ],
)
def test_plan_bad_input_gives_clear_error(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--cluster", H800, "--tokens", "8", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert __import__("re").search(match, err), err


def test_plan_missing_cluster_file(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--cluster", str(tmp_path / "none.yaml")])
    assert exc.value.code == 2
    assert (
        "none.yaml' does not exist and is not a preset name (presets: cpu_2x1, h20_4x8, h800_4x8"
        in capsys.readouterr().err
    )


def test_plan_bench_writes_configs(tmp_path):
    out = tmp_path / "bench.json"
    # 2x2 with routing for every rank; 4x2 with prototype counts (W = 8 > 4) and experts raised to 8
    assert (
        main(
            [
                "plan-bench",
                "--configs",
                "2x2,4x2",
                "--tokens",
                "32",
                "--experts",
                "4",
                "--topk",
                "2",
                "--warmups",
                "0",
                "--repeats",
                "2",
                "--full-routing-max-ranks",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["configs"]
    assert [(r["nodes"], r["gpus_per_node"], r["experts"]) for r in rows] == [(2, 2, 4), (4, 2, 8)]
    assert all(r["ms_per_layer"] > 0 and r["path"] == "joint" for r in rows)
    assert rows[1]["experts_note"] and "prototype" in rows[1]["demand_source"]


def test_plan_bench_bad_config(capsys):
    with pytest.raises(SystemExit):
        main(["plan-bench", "--configs", "4by8"])
    assert "--configs: expected NxG entries such as 4x8, got '4by8'" in capsys.readouterr().err


def test_demo_prints_every_path(capsys):
    assert main(["demo", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    for name in ("native", "rail", "perm", "joint", "rho_g", "kappa", "wave"):
        assert name in out


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_railwave.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for name in EXPECTED_FLAGS:
        assert name.split()[0] in proc.stdout


# ---------------------------------------------------------------------- bad output paths, up front
_OUTPUT_FLAGS = {
    "--json",
    "--out",
    "--plot",
    "--profile-out",
    "--state-dir",
    "--write-model",
    "--learned",
}


def _all_parsers(parser: argparse.ArgumentParser, name: str = "railwave"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_output_flag_is_checked_up_front():
    # Each flag that names a file or directory the command writes is declared (commands._outputs),
    # so railwave checks it before the handler runs.
    missing = []
    for name, parser in _all_parsers(build_parser()):
        declared = set(parser.get_default("output_files") or ()) | set(
            parser.get_default("output_dirs") or ()
        )
        for action in parser._actions:
            if _OUTPUT_FLAGS & set(action.option_strings) and action.dest not in declared:
                if (
                    name
                    in ("railwave testbed run", "railwave testbed online", "railwave testbed down")
                    and action.dest == "state_dir"
                ):
                    continue  # only `up` writes the state directory
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []


def _commands_writing_to(path: str, log_dir: str) -> list[list[str]]:
    return [
        ["plan", "--cluster", H800, "--tokens", "8", "--json", path],
        ["plan-bench", "--configs", "2x2", "--json", path],
        ["demo", "--json", path],
        ["bench-exchange", "--json", path],
        ["bench-exchange", "--profile", "native", "--profile-out", path],
        ["bench", "--cluster", H800, "--json", path],
        ["bench", "--cluster", H800, "--plot", path],
        ["report", log_dir, "--json", path],
        ["testbed", "run", "--json", path],
        ["netmodel", "fit-incast", "--write-model", path],
        ["netmodel", "bench-engine", "--nodes", "2", "--json", path],
        ["simulate-exchange", "--cluster", H800, "--json", path],
        ["workloads", "fit", "--json", path],
    ]


@pytest.mark.parametrize("case", range(13))
def test_output_path_that_is_a_directory_fails_before_any_work(tmp_path, capsys, case):
    argv = _commands_writing_to(str(tmp_path), str(tmp_path))[case]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", f"work was done before the check: {captured.out[:300]}"
    lines = captured.err.strip().splitlines()
    assert (
        len(lines) == 1
        and f"{str(tmp_path)!r} is a directory; give a file name inside it" in lines[0]
    ), lines


@pytest.mark.parametrize("case", [0, 6, 9, 10])
def test_output_path_under_a_file_fails_before_any_work(tmp_path, capsys, case):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    target = str(blocker / "out.json")
    argv = _commands_writing_to(target, str(tmp_path))[case]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"cannot create this file: {str(blocker)!r} is a file, not a directory" in captured.err


def test_report_out_must_be_a_directory(tmp_path, capsys):
    plots = tmp_path / "plots.png"
    plots.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path), "--out", str(plots)])
    assert exc.value.code == 2
    assert f"--out {str(plots)!r} is a file; give a directory" in capsys.readouterr().err


def test_report_missing_directory_says_it_does_not_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "nope")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"log directory {str(tmp_path / 'nope')!r} does not exist; give the directory set as "
        f"--railwave-log-dir" in err
    )
    assert "no railwave" not in err


# ---------------------------------------------------------------------- one node
def _strict_json(path: Path):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_plan_single_node_writes_valid_json(tmp_path):
    out = tmp_path / "one.json"
    assert (
        main(
            [
                "plan",
                "--cluster",
                H800,
                "--nodes",
                "1",
                "--tokens",
                "32",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = _strict_json(out)
    assert data["stats"]["remote_records"] == 0 and data["waves"] == []
    assert data["stats"]["coords"][0] is None  # log2 of zero remote bytes: undefined, not -Infinity


def test_bench_single_node_runs_and_has_no_rail_speedup(tmp_path):
    out = tmp_path / "one.json"
    assert (
        main(
            [
                "bench",
                "--cluster",
                H800,
                "--nodes",
                "1",
                "--layers",
                "1",
                "--tokens",
                "64",
                "--pattern",
                "none,ring",
                "--plan-repeats",
                "0",
                "--no-progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = _strict_json(out)
    for pattern in ("none", "ring"):
        joint = data["summary"][pattern]["variants"]["joint"]
        assert joint["rail_p50_ms"] == 0.0 and joint["rail_speedup_p50"] is None
        assert joint["comm_p50_ms"] > 0 and joint["speedup_p50"] == pytest.approx(
            1.0
        )  # NVLink only


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "1"], "the online run needs at least 2 nodes (got 1)"),
        (["--paths", "joint,rail"], "--paths must include native"),
        (["--steps", "0"], "--steps must be >= 1 (got 0)"),
    ],
)
def test_testbed_online_refuses_bad_flags_up_front(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["testbed", "online", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_testbed_run_refuses_one_node_up_front(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["testbed", "run", "--nodes", "1"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        "the testbed study needs at least 2 nodes (got 1)" in captured.err
        and "--nodes 2 or more" in captured.err
    )


def test_simulate_exchange_fixed_capacity_reports_zero_syncs_and_equality(tmp_path, capsys):
    """--max-tokens-per-rank: 0 host syncs per layer, every path bitwise equal to the others and
    to the normal mode (which makes 1), in the table and the JSON; a capacity below --tokens is
    one error line, exit 2, before any work."""
    out = tmp_path / "sim.json"
    cluster = tmp_path / "c2x2.yaml"
    cluster.write_text("name: c2x2\nnum_nodes: 2\ngpus_per_node: 2\n")
    assert (
        main(
            [
                "simulate-exchange",
                "--cluster",
                str(cluster),
                "--tokens",
                "12",
                "--hidden",
                "8",
                "--experts",
                "8",
                "--topk",
                "3",
                "--max-tokens-per-rank",
                "16",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["max_tokens_per_rank"] == 16 and report["all_bitwise_equal"]
    assert all(report["bitwise_equal_to_normal_mode"].values())
    assert set(report["host_syncs_per_layer"].values()) == {0.0}
    assert set(report["normal_mode"]["host_syncs_per_layer"].values()) == {1.0}
    assert "fixed capacity C=16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "simulate-exchange",
                "--cluster",
                str(cluster),
                "--tokens",
                "12",
                "--experts",
                "8",
                "--max-tokens-per-rank",
                "8",
            ]
        )
    assert exc.value.code == 2
    assert "--tokens 12 exceeds --max-tokens-per-rank 8" in capsys.readouterr().err


ONLINE_SIM_ONE_LAYER = (
    "online-sim",
    "--cluster",
    H800,
    "--nodes",
    "2",
    "--model",
    "megatron_railwave/configs/netmodel/h800_4x8.yaml",
    "--layers",
    "5",
)
"""online-sim on 2 x 8 nodes and one layer (the small runs below add their own sizes)."""


def test_online_sim_small_run_json_and_learned_report(tmp_path, capsys):
    """online-sim on 2 x 8 nodes, one layer, 30 steps: the totals obey their definitions, the
    per-layer path record adds up, and the learned-paths report names the layer's best path."""
    out, learned = tmp_path / "os.json", tmp_path / "learned.yaml"
    argv = [
        *ONLINE_SIM_ONE_LAYER,
        "--tokens",
        "512",
        "--steps",
        "30",
        "--routing-every",
        "15",
        "--seed",
        "0,1",
        "--json",
        str(out),
        "--learned",
        str(learned),
        "--decision-cost",
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    runs = data["models"]["megatron_railwave/configs/netmodel/h800_4x8.yaml"]["runs"]
    assert sorted(runs) == ["0", "1"]
    for run in runs.values():
        t = run["summary"]["totals_s"]
        fixed = [t[f"always_{p}"] for p in tuple(map(str, ROUTES))]
        assert t["oracle_per_call"] <= t["oracle_per_layer"] == pytest.approx(min(fixed))
        assert t["oracle_per_call"] <= t["online"]
        assert t["oracle_per_call"] <= t["oracle_per_epoch"] <= t["oracle_per_layer"]
        assert run["summary"]["planning_measured"] and t["probe_planning_s"] > 0 < t["host_s"]
        assert t["online_charged"] == pytest.approx(
            t["online"] + t["host_s"] + t["probe_planning_s"]
        )
        (layer,) = run["layers"]
        assert sum(layer["chosen"].values()) == 30 and len(layer["path_per_step"]) == 30
        assert layer["mode_per_step"][0] == "probe" and "exploit" in layer["mode_per_step"]
        cost = run["summary"]["cost"]
        assert (
            cost["extra_bytes_per_peer_message"] == 0 == cost["extra_bytes_per_rank_per_layer_call"]
        )
        parts = cost["cpu_us_per_call"]
        assert parts["total"]["mean"] == pytest.approx(
            sum(parts[k]["mean"] for k in ("words", "observe", "descriptors", "decide"))
        )
        assert all(parts[k]["p50"] <= parts[k]["p99"] <= parts[k]["max"] for k in parts)
    printed = capsys.readouterr().out
    assert "goals:" in printed and "demand_stats (reference)" in printed
    # The last seed's report: layer 5's training neighbourhoods, each with its best timed path.
    report = yaml.safe_load(learned.read_text())
    assert report["format"] == "railwave-learned-paths/1" and report["entries"]
    for entry in report["entries"]:
        assert (entry["layer"], entry["pass_kind"]) == (5, "train")
        assert entry["median_s"][entry["best"]] == min(entry["median_s"].values())


def test_online_sim_candidates_reach_the_selector_and_base_from_checks_the_plan_options(
    tmp_path, capsys
):
    """--candidates is the selector's candidate list (it picks nothing else, and the JSON says
    which); --base-from refuses times planned with other --streamed / --chunks."""
    out = tmp_path / "os.json"
    argv = [
        *ONLINE_SIM_ONE_LAYER,
        "--tokens",
        "256",
        "--steps",
        "12",
        "--routing-every",
        "12",
        "--candidates",
        "joint,native",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["candidates"] == ["joint", "native"]
    assert data["settings"]["streamed"] is False
    (run,) = data["models"]["megatron_railwave/configs/netmodel/h800_4x8.yaml"]["runs"].values()
    (layer,) = run["layers"]
    assert set(layer["path_per_step"]) == {"joint", "native"}
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--base-from", str(out), "--streamed"])
    assert "planned with chunks=1, streamed=False; this run asks for" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--candidates", "rail,native"])
    assert "must include joint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--candidates", "joint,joint+streamed"])
    assert "have no times in this base" in capsys.readouterr().err
    # --streamed times every route twice; a '+streamed' candidate then runs and is reported.
    streamed_out = tmp_path / "streamed.json"
    assert (
        main(
            [*argv[:-4], "--streamed", "--candidates", "joint,joint+streamed"]
            + ["--json", str(streamed_out)]
        )
        == 0
    )
    data = json.loads(streamed_out.read_text())
    (run,) = data["models"]["megatron_railwave/configs/netmodel/h800_4x8.yaml"]["runs"].values()
    (layer,) = run["layers"]
    assert set(layer["path_per_step"]) == {"joint", "joint+streamed"}
    assert len(layer["fixed_s"]) == 2 * len(ROUTES) and "flow-waves+streamed" in layer["fixed_s"]
    assert "always_joint+streamed" in run["summary"]["totals_s"]

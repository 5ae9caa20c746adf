"""Device profiles users write: files load into the same profile the cost model uses, mistakes are diagnostics."""

import json
from pathlib import Path

import pytest

from shardplan.cli.commands import main
from shardplan.plan.diagnostics import PlanError
from shardplan.planner.profiles import PROFILES, get_profile, load_profile

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = """name: mine
peak_flops: 312e12
memory_bytes: 80GiB
memory_bandwidth: 2.0e12
intra_host_bandwidth: 300e9
inter_host_bandwidth: 25e9
devices_per_host: 8
"""


def test_a_minimal_profile_file_loads_with_the_documented_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(MINIMAL)
    profile = get_profile(str(path))
    assert profile.peak_flops == 312e12 and profile.memory_bytes == 80 * 2**30
    assert profile.matmul_efficiency == 0.8 and profile.link_efficiency == 0.8
    assert profile.collective_latency == 10e-6 and profile.attention == "materialised"
    assert profile.tick_overhead == 30e-6
    assert profile.flops_for("float32") == 312e12  # no per-dtype figure: the peak


def test_toml_profile_and_per_dtype_peaks(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "t"\npeak_flops = "989e12"\nmemory_bytes = 80e9\nmemory_bandwidth = 3.35e12\n'
        "intra_host_bandwidth = 450e9\ninter_host_bandwidth = 50e9\ndevices_per_host = 8\n"
        "peak_flops_by_dtype = {float32 = 494e12}\n"
    )
    profile = load_profile(path)
    assert profile.flops_for("float32") == 494e12 and profile.flops_for("bfloat16") == 989e12


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "profiles").glob("*.yaml")))
def test_shipped_profile_files_load(name):
    profile = load_profile(ROOT / "profiles" / name)
    assert profile.source.endswith(name) and profile.devices_per_host == 8


@pytest.mark.parametrize(
    "edit, code, where",
    [
        (("peak_flops: 312e12", "peak_flops: lots"), "invalid-value", (2, "peak_flops")),
        (("peak_flops: 312e12", "peak_flops: 1e400"), "invalid-value", (2, "peak_flops")),  # infinite
        (("memory_bandwidth:", "memory_bandwith:"), "unknown-key", (4, "memory_bandwith")),
        (("devices_per_host: 8", "devices_per_host: 0"), "invalid-value", (7, "devices_per_host")),
        (("devices_per_host: 8", "devices_per_host: 8\nlink_efficiency: 1.5"), "invalid-value", (8, "link_efficiency")),
        (("inter_host_bandwidth: 25e9\n", ""), "missing-key", (None, "inter_host_bandwidth")),
        (("devices_per_host: 8", "devices_per_host: 8\ntick_overhead: -1e-3"), "invalid-value", (8, "tick_overhead")),
        # each value valid alone, together slower than any device (their product underflowed to a division by 0)
        (
            (
                "inter_host_bandwidth: 25e9\ndevices_per_host: 8",
                "inter_host_bandwidth: 1e4\ndevices_per_host: 8\nlink_efficiency: 1e-3\ncollective_shares: {all-reduce: 1e-3}",
            ),
            "invalid-value",
            (8, "the share of all-reduce"),
        ),
        (("devices_per_host: 8", "devices_per_host: 8\nmatmul_efficiency: 1e-300"), "invalid-value", (8, "0.001")),
        (("devices_per_host: 8", "devices_per_host: true"), "invalid-value", (7, "devices_per_host")),
        (
            ("devices_per_host: 8", "devices_per_host: 8\nmatmul_points: [[1024, 0, 1024, 1e-5]]"),
            "invalid-value",
            (8, "matmul_points"),
        ),
        (("devices_per_host: 8", "devices_per_host: " + "8" * 5000), "invalid-value", (7, "5,000 characters")),
        (("peak_flops: 312e12", "peak_flops: 3" + "1" * 300 + "e-290"), "invalid-value", (2, "characters")),
    ],
)
def test_bad_profiles_are_diagnostics_at_their_lines(tmp_path, edit, code, where):
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL.replace(*edit))
    with pytest.raises(PlanError) as caught:
        load_profile(path)
    found = next(d for d in caught.value.diagnostics if d.code == code)
    line, name = where
    assert found.code == code and name in found.message
    if line:
        assert found.line == line


def test_a_long_number_in_a_toml_profile_or_plan_is_refused_at_its_line(tmp_path):
    import shardplan

    path = tmp_path / "long.toml"
    path.write_text(
        'name = "t"\npeak_flops = 1e12\nmemory_bytes = 80e9\nmemory_bandwidth = 3e12\n'
        "intra_host_bandwidth = 450e9\ninter_host_bandwidth = 50e9\ndevices_per_host = " + "8" * 5000 + "\n"
    )
    with pytest.raises(PlanError) as caught:
        load_profile(path)
    assert [(d.code, d.line) for d in caught.value.diagnostics] == [("invalid-value", 7)]
    for digits in (100, 5000):
        plan = tmp_path / "plan.toml"
        plan.write_text(f"version = 1\n[mesh.axes]\ndata = {'1' * digits}\n[[params]]\nmatch = '.*'\nspec = []\n")
        with pytest.raises(PlanError) as caught:
            shardplan.load_plan(plan)
        assert [(d.code, d.line) for d in caught.value.diagnostics] == [("invalid-value", 3)]
        assert f"{digits:,} characters" in caught.value.diagnostics[0].message


def test_cli_lists_profiles_and_rejects_a_bad_file(tmp_path, capsys):
    shipped = sorted(path.stem for path in (Path(__file__).parents[1] / "profiles").glob("*.yaml"))
    assert main(["profiles", "--json"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)] == list(PROFILES) + shipped
    assert main(["profiles"]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert "profile files shipped in profiles: " + ", ".join(f"{name}.yaml" for name in shipped) in listed
    assert "not on the machine at hand" in listed and "this machine's" not in listed
    assert "989 (" in listed and "0.0275" in listed  # three significant figures, not `0.0275000`-style noise
    assert listed.count("remat frees nothing") == 1  # the cpu profile's `remat_frees: false`, said
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL.replace("peak_flops: 312e12", "peak_flops: -1"))
    assert main(["profiles", str(path)]) == 1
    assert "peak_flops" in capsys.readouterr().err
    assert (
        main(
            [
                "auto",
                "--model",
                "minigpt_model:MiniGPT",
                "--devices",
                "8",
                "--profile",
                "nope.txt",
                "-o",
                str(tmp_path / "a.yaml"),
            ]
        )
        == 2
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("peak_flops", "1e-300"),
        ("memory_bandwidth", "1e-320"),
        ("collective_latency", "1e308"),
        ("memory_bytes", "1e400"),
    ],
)
def test_a_profile_figure_no_device_has_is_refused(tmp_path, field, value):
    from shardplan.planner.profiles import load_profile

    figures = {
        "name": "x",
        "peak_flops": "1e14",
        "memory_bytes": "80GiB",
        "memory_bandwidth": "1e12",
        "intra_host_bandwidth": "1e11",
        "inter_host_bandwidth": "1e10",
        "devices_per_host": "8",
    }
    figures[field] = value
    path = tmp_path / "profile.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in figures.items()))
    with pytest.raises(Exception) as caught:
        load_profile(str(path))
    assert field in str(caught.value)


def test_a_profile_file_says_which_settings_it_left_to_the_defaults(tmp_path):
    from shardplan.planner.profiles import load_profile

    path = tmp_path / "a100.yaml"
    path.write_text(
        "name: a100\npeak_flops: 312e12\nmemory_bytes: 80GB\nmemory_bandwidth: 2.0e12\n"
        "intra_host_bandwidth: 300e9\ninter_host_bandwidth: 25e9\ndevices_per_host: 8\n"
    )
    line = load_profile(path).defaults_line()
    for setting in ("attention=materialised", "overlap=True", "matmul_efficiency=0.8", "collective_latency=1e-05"):
        assert setting in line, line
    path.write_text(path.read_text() + "attention: fused\noverlap: false\n")
    line = load_profile(path).defaults_line()
    assert "attention=" not in line and "overlap=" not in line and "link_efficiency=0.8" in line


def test_no_accelerator_profile_carries_what_the_cpu_backend_taught():
    """bf16 computed in float32, collectives that wait, devices sharing cores, per-kind link shares and
    remat's barriers expanded before the last CSE are what XLA's CPU backend does (the `cpu` profile, or
    one `calibrate` measures on CPU); the built-in and shipped accelerator profiles say none of it."""
    cpu = get_profile("cpu")
    assert not cpu.low_precision_native and not cpu.overlap and cpu.shared_compute and not cpu.remat_frees
    accelerators = [PROFILES["h200"], PROFILES["tpu-v5e"]] + [
        load_profile(path) for path in sorted((ROOT / "profiles").glob("*.yaml"))
    ]
    for profile in accelerators:
        assert profile.low_precision_native and not profile.shared_compute and profile.remat_frees, profile.name
        assert not profile.collective_shares and profile.tick_overhead < 1e-3, profile.name

"""Plugins named by a configuration run only with the caller's consent, and
a garbage descriptor is refused before anything reads through it.

The probe: ductile.load_config(file) ran the constructors of the plugins in
a folder the file's own [plugins] path names, with no opt-in (`ductile config
check` needs --allow-config-plugins for that); and a plugin in a trusted
folder whose entry point returns a garbage descriptor crashed `ductile
plugins list` (SIGSEGV, exit 139). The fixture plugin leaves a marker file
when its library is loaded, so each case shows whether its code ran."""

import json
import os
import shutil
import subprocess

import pytest
import torch

import ductile
from conftest import CLI

FIXTURES = os.path.join(os.environ["DUCTILE_BINARY_DIR"], "tests", "core", "loader", "fixtures")
MARKED = os.path.join(FIXTURES, "trust", "libductile_lr_fixture_marked.so")
GARBAGE = os.path.join(FIXTURES, "garbage")

ZERO = """
[accelerator]
backend = "cpu"
communicator = "auto"

[zero]
coordinator = "partitioned"
"""


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """A folder as received from elsewhere: a plugin (its library leaves
    markers/fixture_marked.ran when loaded) beside configurations that name
    the folder in [plugins] path. Returns (folder, marker)."""
    folder = tmp_path / "bundle"
    folder.mkdir(mode=0o755)
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("DUCTILE_FIXTURE_MARKER_DIR", str(markers))
    return folder, markers / "fixture_marked.ran"


def plant(folder, name):
    shutil.copy(MARKED, folder / name)  # a new path: a new library, whose constructor runs


def test_load_config_runs_no_plugin_of_a_config_named_folder_without_consent(bundle):
    folder, marker = bundle
    plant(folder, "libductile_lr_fixture_marked.so")
    job = folder / "job.toml"
    job.write_text('[plugins]\npath = ["."]\n\n[lr]\nrule = "fixture_marked"\n')
    with pytest.raises(ductile.ConfigError) as error:
        ductile.load_config(job)
    message = str(error.value)
    assert "no lr plugin named 'fixture_marked'" in message
    assert f"not searched: '{folder}/.' (named by the configuration's [plugins] path; Python " \
           "loads no plugin from there unless the caller passes allow_config_plugins=True)" \
        in message, message
    assert not marker.exists()
    # The same text, and a dict of sections, are read alike.
    with pytest.raises(ductile.ConfigError, match="allow_config_plugins=True"):
        ductile.load_config(f'[plugins]\npath = ["{folder}"]\n[lr]\nrule = "fixture_marked"\n')
    with pytest.raises(ductile.ConfigError, match="allow_config_plugins=True"):
        ductile.load_config({"plugins": {"path": [str(folder)]}, "lr": {"rule": "fixture_marked"}},
                            format="toml")
    assert not marker.exists()

    config = ductile.load_config(job, allow_config_plugins=True)
    assert config.runtime.section("lr")["plugin"] == "fixture_marked"
    assert marker.exists()  # consent given: its code ran
    with pytest.raises(ductile.InvalidArgumentError, match="allow_config_plugins = 'yes' is not "
                                                           "a bool"):
        ductile.load_config(job, allow_config_plugins="yes")


def test_zero3_initialize_needs_consent_too(bundle):
    """The config lets its folder replace the built-in coordinator: without
    consent the built-in one runs and the folder is not looked at; with it,
    the folder's library is loaded (and refused: it is no coordinator)."""
    import ductile.torch.zero3 as zero3
    folder, marker = bundle
    plant(folder, "libductile_zero_partitioned.so")
    job = folder / "zero.toml"
    job.write_text('[plugins]\npath = ["."]\noverride_builtin = ["zero/partitioned"]\n' + ZERO)
    engine = zero3.initialize(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1),
                              str(job))
    assert engine.world_size == 1 and not marker.exists()
    with pytest.raises(ductile.Error, match="libductile_zero_partitioned.so' declares plugin "
                                            "lr/fixture_marked but its file name says "
                                            "zero/partitioned"):
        zero3.initialize(torch.nn.Linear(4, 4), None, str(job), allow_config_plugins=True)
    assert marker.exists()


def test_a_deepspeed_config_names_no_plugin_folder(bundle):
    """compute_elastic_config takes a DeepSpeed dict: a `plugins` block in it
    is not read, so the folder it names is never searched."""
    folder, marker = bundle
    plant(folder, "libductile_elasticity_marked.so")
    ds = {"plugins": {"path": [str(folder)]},
          "elasticity": {"enabled": True, "policy": "marked", "max_train_batch_size": 100,
                         "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 4}}
    with pytest.raises(ductile.NotFoundError, match="no elasticity plugin named 'marked'"):
        ductile.elasticity.compute_elastic_config(ds, "0.9.0", world_size=2)
    with pytest.raises(ductile.NotFoundError, match="no elasticity plugin named 'marked'"):
        ductile.elasticity.load(ds)
    assert not marker.exists()


def test_garbage_descriptors_are_listed_as_problems_not_crashes():
    names = sorted(f for f in os.listdir(GARBAGE) if f.startswith("libductile_lr_garbage_"))
    assert len(names) == 6, names
    env = dict(os.environ, DUCTILE_PLUGIN_PATH=GARBAGE)
    proc = subprocess.run([CLI, "plugins", "list"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    for name in names:
        assert any(os.path.join(GARBAGE, name) in p and "the plugin was not used" in p
                   for p in problems), (name, problems)
    proc = subprocess.run([CLI, "plugins", "list", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert not any(p["name"].startswith("garbage_") for p in listed["plugins"])
    assert sorted(os.path.basename(p["file"]) for p in listed["problems"]
                  if "garbage" in p["file"]) == names
    # And in this process, through the Python package.
    assert not any(p["name"].startswith("garbage_") for p in ductile.plugins(plugin_path=[GARBAGE]))

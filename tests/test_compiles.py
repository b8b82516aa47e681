"""Kernel compiles across processes (tiered_emb/_compiles.py): one compile of a kernel that two
processes reach at once, and a list of a run's kernels that another process compiles for it."""

from __future__ import annotations

import base64
import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

from tiered_emb.apps import warm

_CALL = """
import numpy as np
from tiered_emb.cache.index import index_find_many, new_index
from tiered_emb.step.gather import pool_kernel

keys, vals = new_index(16)
index_find_many(keys, vals, np.arange(3), np.empty(3, np.int64))
pool = pool_kernel(4, True, False)
rows = np.ones((8, 4), np.float32)
out = np.zeros((1, 4), np.float32)
ix = np.arange(3)
pool(rows, ix, ix, False, 8, np.array([0, 3]), np.zeros(0, np.float32), False, out)
assert out.tolist() == [[3.0] * 4]
"""


def _python(code: str, cache: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdout=subprocess.PIPE, text=True
    )


_COUNTED = """
from numba.core import event

compiles = []


class Count(event.Listener):
    def on_start(self, ev):
        compiles.append(ev)

    def on_end(self, ev):
        pass


event.register("numba:compile", Count())
"""


def test_two_processes_reaching_a_kernel_at_once_compile_it_once(tmp_path):
    """Both wait for a file, then call the same kernel in an empty cache: one compiles it, the
    other waits for its lock and loads it (without the lock both would compile it)."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    cache.mkdir()
    code = (
        "import os, sys, time\nimport tiered_emb\n"
        "from tiered_emb.cache.index import index_find_many, new_index\nimport numpy as np\n"
        "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.005)\n"
        "keys, vals = new_index(16)\nindex_find_many(keys, vals, np.arange(3), np.empty(3, np.int64))\n"
        "s = index_find_many.stats\nprint(sum(s.cache_misses.values()), sum(s.cache_hits.values()))\n"
    )
    procs = [_python(code, cache, str(go)) for _ in range(2)]
    go.write_text("")
    got = sorted(p.communicate(timeout=300)[0].split() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert got == [["0", "1"], ["1", "0"]]  # one compile, one load
    assert any((cache / "locks").iterdir())


def test_a_recorded_list_compiles_a_later_runs_kernels(tmp_path):
    """Process 1 records the kernels a piece of work calls (one made by a factory); process 2,
    with an empty cache, compiles that list; process 3 does the work and compiles nothing."""
    listed = tmp_path / "kernels.json"
    record = (
        "import json, sys\nimport numba\nfrom tiered_emb import _compiles\n"
        "with _compiles.recording() as entries:\n" + textwrap.indent(_CALL, "    ") + "\n"
        "json.dump({'numba': numba.__version__, 'kernels': entries}, open(sys.argv[1], 'w'))\n"
    )
    first = _python(record, tmp_path / "cache1", str(listed))
    first.communicate(timeout=300)
    assert first.returncode == 0
    entries = json.loads(listed.read_text())["kernels"]
    names = [e["kernel"] for e in entries]
    assert names == ["tiered_emb.cache.index:index_find_many", "tiered_emb.step.gather:pool_kernel"]
    assert entries[1]["made_by"] == [4, True, False]

    cache = tmp_path / "cache2"
    compile_all = (
        "import json, sys\nfrom tiered_emb import _compiles\nd = json.load(open(sys.argv[1]))\n"
        "print(_compiles.compile_listed(d['kernels'], d['numba']), _compiles.compile_listed(d['kernels'], 'other'))\n"
    )
    second = _python(compile_all, cache, str(listed))
    assert second.communicate(timeout=300)[0].split() == ["2", "0"]  # (another Numba's list: nothing)
    third = _python(_COUNTED + "import tiered_emb\n" + _CALL + "print(len(compiles))\n", cache)
    assert third.communicate(timeout=300)[0].split() == ["0"]
    assert third.returncode == 0


def test_the_shipped_list_names_kernels_that_exist():
    """Every entry of the default job's list (apps/kernels.json) is a kernel of the package
    (made by its factory where it says so) whose signature unpickles with as many types as the
    kernel takes parameters, and the list's shape is what the default job hands its small job."""
    listed = json.loads(warm.KERNELS.read_text())
    assert len(listed["kernels"]) >= 20
    for entry in listed["kernels"]:
        module, qualname = entry["kernel"].split(":")
        kernel = __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            kernel = getattr(kernel, part)
        if "made_by" in entry:
            kernel = kernel(*entry["made_by"])
        sig = pickle.loads(base64.b64decode(entry["sig"]))
        assert len(sig) == len(inspect.signature(kernel.py_func).parameters), entry["kernel"]
    assert listed["shape"]["--dim"] == "16" and listed["shape"]["--optimizer"] == "rowwise_adagrad"
    assert warm.shape_of(["--dim", "16", "--rows", "9", "--policy", "lru"]) == {"--dim": "16", "--policy": "lru"}


def test_the_list_serves_a_run_of_its_shape_at_any_dim_and_policy(tmp_path):
    """A run whose table shape is the list's but for its dim and policy gets the list: the
    kernels made for a dim made for its dim, those that take a policy tag typed for its
    policy; a run of another shape (other types) gets nothing from it."""
    import numba

    from tiered_emb.cache.policies import POLICIES, PolicyType
    from tiered_emb.cache.slots import cache_release
    from tiered_emb.step.gather import pool_kernel

    shipped = json.loads(warm.KERNELS.read_text())
    (pool,) = [e for e in shipped["kernels"] if e["kernel"] == "tiered_emb.step.gather:pool_kernel"]
    (release,) = [e for e in shipped["kernels"] if e["kernel"] == "tiered_emb.cache.slots:cache_release"]
    listed = tmp_path / "kernels.json"
    shape = {"--dim": "16", "--policy": "lookahead+lru", "--dtype": "float32"}
    listed.write_text(json.dumps({"numba": numba.__version__, "shape": shape, "kernels": [pool, release]}))
    assert not warm.compile_kernels(shape | {"--dim": "8", "--dtype": "float16"}, listed)
    assert not warm.compile_kernels(shape | {"--policy": "no-such-policy"}, listed)
    assert not warm.compile_kernels(shape, tmp_path / "missing.json")
    assert warm.compile_kernels(shape | {"--dim": "8", "--policy": "sieve"}, listed)
    made = pool_kernel(8, *pool["made_by"][1:])
    assert tuple(pickle.loads(base64.b64decode(pool["sig"]))) in made.signatures
    sig = pickle.loads(base64.b64decode(release["sig"]))
    assert isinstance(sig[0], PolicyType) and sig[0].code != POLICIES["sieve"].code
    assert (PolicyType(POLICIES["sieve"].code), *sig[1:]) in cache_release.signatures

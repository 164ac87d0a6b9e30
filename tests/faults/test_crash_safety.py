"""kill -9 at every write step of replacing a tenant's adapter or a domain: after a restart the
old version or the new one is served, never neither (and never a mix)."""

import pytest

from hmi.adapters.store import AdapterStore
from tests.faults.killpoints import run_until_complete
from tests.helpers.crash import SPEC, open_tree, weights  # noqa: F401

ADAPTER_CHILD = """
import sys
from tests.faults.killpoints import kill_each_step
from tests.helpers.crash import SPEC, weights
from hmi.adapters.store import AdapterStore

def replace(counter):
    store = AdapterStore(sys.argv[1])
    counter["on"] = True
    if sys.argv[2] == "publish":
        store.save("acme", SPEC, weights(2.0))
    else:
        store.delete("acme")

kill_each_step(replace)
"""


@pytest.mark.parametrize("operation", ["publish", "delete"])
def test_kill_at_every_write_step_of_an_adapter_replacement_leaves_old_or_new(tmp_path, operation):
    root = tmp_path / "tenants"
    seen = set()

    def check(k):
        store = AdapterStore(root)
        store.recover()
        if operation == "delete" and not store.exists("acme"):
            seen.add("gone")
        else:
            value = float(store.load("acme")["head.b"][0])  # readable, and all of one version
            assert value in (1.0, 2.0), value
            assert all(float(t.float().mean()) == value for t in store.load("acme").values())
            seen.add(value)
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        assert not leftovers, leftovers
        fresh(root)

    def fresh(root):
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        AdapterStore(root).save("acme", SPEC, weights(1.0))

    fresh(root)
    points = run_until_complete(ADAPTER_CHILD, [str(root), operation], check)
    assert points >= 4, points
    assert seen >= ({1.0, 2.0} if operation == "publish" else {1.0, "gone"}), seen


DOMAIN_CHILD = """
import sys
from tests.faults.killpoints import kill_each_step
from tests.helpers.crash import open_tree
from hmi.version_tree.tree import VersionTree
from tests.helpers.domains import TINY, corpus

def update(counter):
    tree = open_tree(sys.argv[1])
    place = VersionTree._place
    def armed_place(self, work, node):  # count from the end of the build on: the replacement itself
        counter["on"] = True
        return place(self, work, node)
    VersionTree._place = armed_place
    tree.update("legal", corpus(300, seed=5), TINY, progress=False)

kill_each_step(update)
"""


@pytest.mark.slow
def test_kill_at_every_write_step_of_a_domain_update_leaves_old_or_new(tmp_path):
    import shutil

    from hmi.plot.paths import ensure_root_plot
    from tests.helpers.domains import TINY, corpus

    base = tmp_path / "base"
    tree = open_tree(base)
    ensure_root_plot(tree.root, lines=corpus(50, seed=9), home=base, progress=False)
    tree.create("legal", "root", corpus(600), 0.5, TINY, progress=False)
    old = tree.nodes()["legal"].version
    home = tmp_path / "home"
    seen = set()

    def check(k):
        t = open_tree(home)
        node = t.nodes()["legal"]
        seen.add("old" if node.version == old else "new")
        lookup = t.lookup("legal")  # its weights and PLOT open and read
        assert lookup.chain[0].store.stats()["entries"] > 0
        reset()

    def reset():
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(base, home, symlinks=True)

    reset()
    points = run_until_complete(DOMAIN_CHILD, [str(home)], check)
    assert points >= 4, points
    assert seen == {"old", "new"}, seen

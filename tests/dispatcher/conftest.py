"""The module-scoped live tiny server that the server tests share (each module gets its own)."""

import pytest

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, TAGS, TRAIN, tiny_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import os

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home = tmp_path_factory.mktemp("home")
    server = tiny_server(home)
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    out = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
    out_b = admin.create_tenant("beta", ["D", "N", "V"], task_type="tagging", training_data={"train": TAGS * 3},
                                adapter={"kind": "lora", "rank": 4}, epochs=1)
    assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    assert admin.wait_job(out_b["job"], 300)["state"] == "succeeded"
    yield {"url": url, "stop": stop, "admin": admin, "alpha": Client(url, out["token"]), "beta": Client(url, out_b["token"]),
           "home": home, "server": server}
    stop()

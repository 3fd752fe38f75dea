"""Pack servers spread over a two-node Ray cluster (`ray.cluster_utils.Cluster`, two raylets
on this machine) by Ray's own scheduling, and Tune trials train on both.

The machine has no GPU, so each node advertises one unit of a custom resource,
`pack_server`, and every pack server asks for one: Ray can only place them one per node.
On GPU nodes `{"GPU": 1}` plays that part (and the default is one server per GPU).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray import tune  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import lora_sweep as ls  # noqa: E402
from lora_sweep.integrations.ray_tune import PackedExecutor  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"pack_server": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"pack_server": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_one_pack_server_per_node_and_trials_on_both(two_nodes, tiny_llama_dir, toy_data, tmp_path):
    train, dev = toy_data
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=train, eval_data=dev, max_seq_len=32, eval_every=5,
                      output_dir=str(tmp_path / "runs"))
    with PackedExecutor(spec, num_servers=2, resources_per_server={"CPU": 1, "pack_server": 1},
                        max_adapters_per_server=2) as executor:
        servers = executor.stats()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        assert {s["node_id"] for s in servers} == nodes  # one pack server on each node

        analysis = executor.run(
            config={"rank": 4, "dropout": 0.0, "batch_size": 4, "max_steps": 30,
                    "learning_rate": tune.grid_search([1e-3, 3e-3, 1e-2, 3e-2])},
            storage_path=str(tmp_path / "tune"), verbose=0,
        )
        assert all(t.status == "TERMINATED" for t in analysis.trials)
        results = analysis.results_df
        assert (results["step"] == 30).all() and results["eval_loss"].notna().all()
        # Four trials at once, two slots per pack: both packs trained trials.
        assert set(results["pack_id"]) == {s["pack_id"] for s in servers}
        assert all(s["model_loads"] == 1 for s in executor.stats())

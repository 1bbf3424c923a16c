"""The TorchRec DLRM, its sharding and its optimizers.

- `ModelConfig` (model_config.py, free of torch so a flow's process can plan without it):
  table sizes come from the data schema (one table per sparse feature); the config holds the
  embedding dimension and the MLP layer sizes.
- `build_dlrm`: a DLRM (EmbeddingBagCollection, dense arch, interaction, over arch) on the
  meta device for the tables, so sharding materializes only each rank's shard.
- `shard`: `DistributedModelParallel` with the planner and a fused embedding optimizer
  (row-wise Adagrad applied in backward). The dense part is replicated without DDP: its
  gradients are averaged by the training group's `average_grads` (trainer/collectives.py) in
  one flat all-reduce, which keeps the
  dense forward a plain function that torch.compile can take whole (see `DenseStep`).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from .collectives import Group
from .data.schema import FeatureSchema
from .model_config import ModelConfig

__all__ = ["ModelConfig", "build_dlrm", "shard", "DenseStep"]


def table_configs(schema: FeatureSchema, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{f.name}", embedding_dim=dim, num_embeddings=f.num_embeddings, feature_names=[f.name]
        )
        for f in schema.sparse
    ]


def build_dlrm(config: ModelConfig, schema: FeatureSchema, *, device: torch.device) -> DLRM:
    torch.manual_seed(config.seed)
    ebc = EmbeddingBagCollection(tables=table_configs(schema, config.embedding_dim), device=torch.device("meta"))
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=len(schema.dense),
        dense_arch_layer_sizes=list(config.dense_arch),
        over_arch_layer_sizes=list(config.over_arch),
        dense_device=device,
    )


class _Replicated(DataParallelWrapper):
    """Keep the dense part as plain modules: gradients are averaged by `Group.average_grads`."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        return None


def shard(model: DLRM, config: ModelConfig, training: Group, *,
          known_plan: ShardingPlan | None = None) -> DistributedModelParallel:
    """The model sharded over the `training` group, on its device (its dense parameters
    broadcast from rank 0). `known_plan`: a plan rank 0 made before for the same tables and
    world (a live recovery rebuilds the module on a new group): rank 0 broadcasts it instead of
    planning again."""
    pg, device = training.pg, training.device
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": config.sparse_lr})
    # ShardedTensor state: checkpoint.staging stages its local shards (DTensor output fails in
    # torchrec 1.8 when a rank holds no shard of a table: DTensor.from_local of a [0, 0] shard)
    env = ShardingEnv.from_process_group(pg)
    topology = Topology(world_size=env.world_size, compute_device=device.type)
    # Model-parallel sharding only: a data-parallel table would need DDP to sync its gradients,
    # and the dense part here is averaged by `Group.average_grads`, not by DDP.
    sharded = [t.value for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)]
    constraints = {
        cfg.name: ParameterConstraints(sharding_types=sharded)
        for cfg in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    }
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    if known_plan is None:
        plan = planner.collective_plan(model, pg=pg)
    else:  # every rank takes part in the broadcast; only rank 0's plan counts, as in collective_plan
        plan = invoke_on_rank_and_broadcast_result(pg, 0, lambda: known_plan)
    dmp = DistributedModelParallel(module=model, env=env, device=device, plan=plan, data_parallel_wrapper=_Replicated())
    training.broadcast_params(dense_parameters(dmp))
    return dmp


def dense_parameters(dmp: DistributedModelParallel) -> list[nn.Parameter]:
    dlrm = dmp.module
    return [p for m in (dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch) for p in m.parameters()]


def dense_optimizer(dmp: DistributedModelParallel, config: ModelConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(dense_parameters(dmp), lr=config.dense_lr)


class DenseStep(nn.Module):
    """Everything after the embedding lookup: dense arch, interaction, over arch, loss.
    Its inputs have fixed shapes ([B, dense], [B, F, D], [B]), so it compiles once."""

    def __init__(self, dlrm: DLRM) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch

    def forward(
        self, dense: torch.Tensor, embedded: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=embedded)
        logits = self.over_arch(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return loss, logits

"""Reference models for shardplan: GPT, Llama and MoE in Flax NNX, their configs and a train step.

Sizes range from tiny (CPU tests) to GPT-3 175B (planned abstractly); presets live in
``configs/models/*.yaml``.

Example:
    >>> import shardplan_models as models
    >>> config = models.load_model_config("gpt-tiny")
    >>> graphdef, state = models.abstract_train_state(config)
"""

from shardplan_models.build import abstract_state as abstract_state
from shardplan_models.build import build_model as build_model
from shardplan_models.build import count_params as count_params
from shardplan_models.common import CausalSelfAttention as CausalSelfAttention
from shardplan_models.common import GeluMLP as GeluMLP
from shardplan_models.common import SwiGLU as SwiGLU
from shardplan_models.config import GPTConfig as GPTConfig
from shardplan_models.config import LlamaConfig as LlamaConfig
from shardplan_models.config import ModelConfig as ModelConfig
from shardplan_models.config import MoEConfig as MoEConfig
from shardplan_models.config import config_from_dict as config_from_dict
from shardplan_models.config import expert_capacity as expert_capacity
from shardplan_models.config import load_model_config as load_model_config
from shardplan_models.config import preset_names as preset_names
from shardplan_models.gpt import GPT as GPT
from shardplan_models.gpt import GPTBlock as GPTBlock
from shardplan_models.llama import Llama as Llama
from shardplan_models.llama import LlamaBlock as LlamaBlock
from shardplan_models.moe import MoE as MoE
from shardplan_models.moe import MoEBlock as MoEBlock
from shardplan_models.moe import MoEMLP as MoEMLP
from shardplan_models.moe import load_balancing_loss as load_balancing_loss
from shardplan_models.train import abstract_train_state as abstract_train_state
from shardplan_models.train import example_batch as example_batch
from shardplan_models.train import init_train_state as init_train_state
from shardplan_models.train import make_optimizer as make_optimizer
from shardplan_models.train import make_train_step as make_train_step

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "GPTBlock",
    "GPTConfig",
    "GeluMLP",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "ModelConfig",
    "SwiGLU",
    "abstract_state",
    "abstract_train_state",
    "build_model",
    "config_from_dict",
    "count_params",
    "example_batch",
    "expert_capacity",
    "init_train_state",
    "load_balancing_loss",
    "load_model_config",
    "make_optimizer",
    "make_train_step",
    "preset_names",
]

"""Reference models for shardplan: GPT, Llama and MoE in Flax NNX, their configs and a train step.

Sizes range from tiny (CPU tests) to GPT-3 175B (planned abstractly); presets live in
``configs/models/*.yaml``.

Example:
    >>> import models
    >>> config = models.load_model_config("gpt-tiny")
    >>> graphdef, state = models.abstract_train_state(config)
"""

from models.build import abstract_state as abstract_state
from models.build import build_model as build_model
from models.build import count_params as count_params
from models.common import CausalSelfAttention as CausalSelfAttention
from models.common import GeluMLP as GeluMLP
from models.common import SwiGLU as SwiGLU
from models.config import GPTConfig as GPTConfig
from models.config import LlamaConfig as LlamaConfig
from models.config import ModelConfig as ModelConfig
from models.config import MoEConfig as MoEConfig
from models.config import config_from_dict as config_from_dict
from models.config import expert_capacity as expert_capacity
from models.config import load_model_config as load_model_config
from models.config import preset_names as preset_names
from models.gpt import GPT as GPT
from models.gpt import GPTBlock as GPTBlock
from models.llama import Llama as Llama
from models.llama import LlamaBlock as LlamaBlock
from models.moe import MoE as MoE
from models.moe import MoEBlock as MoEBlock
from models.moe import MoEMLP as MoEMLP
from models.moe import load_balancing_loss as load_balancing_loss
from models.train import abstract_train_state as abstract_train_state
from models.train import example_batch as example_batch
from models.train import init_train_state as init_train_state
from models.train import make_optimizer as make_optimizer
from models.train import make_train_step as make_train_step

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

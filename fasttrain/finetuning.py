"""Freezing and unfreezing parts of a model for transfer learning."""

from __future__ import annotations

from collections import namedtuple
from typing import Dict, List, Tuple

import torch

__all__ = ["ModelFreezer", "Layer", "LayerGroup", "BN_MODULES"]

BN_MODULES = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)

Layer = namedtuple("Layer", ["layer_group_idx", "module", "is_frozen"])
LayerGroup = namedtuple("LayerGroup", ["layer_group_idx", "module", "is_frozen"])


def _module_is_batch_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a batch-norm layer (kept under pytorch-accelerated's name, which its
    users' tests import)."""
    return isinstance(module, BN_MODULES)


def _leaf_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    children = list(module.children())
    if not children:
        return [module]
    leaves = []
    for child in children:
        leaves.extend(_leaf_modules(child))
    return leaves


class ModelFreezer:
    """Freezes and unfreezes a model by layer group, for fine-tuning.

    A *layer group* is a direct child of the model (an attribute such as ``backbone`` or
    ``head``); a *layer* is a module with no children, found by walking each group in order.
    Layer groups are addressed by index, negative indices counting from the end, and a range
    includes both ends. Parameters owned directly by a module that also has children belong to
    no layer and are left alone.

    Batch-norm layers are skipped (left trainable) unless ``freeze_batch_norms`` is True.

    Creating a freezer makes every parameter of the model trainable.
    """

    def __init__(self, model: torch.nn.Module, freeze_batch_norms: bool = False):
        """
        :param model: the model to freeze and unfreeze
        :param freeze_batch_norms: also freeze batch-norm layers
        """
        self.model = model
        for param in model.parameters():
            param.requires_grad = True
        self._layer_groups: Dict[int, torch.nn.Module] = {}
        self._layers: List[Tuple[int, torch.nn.Module]] = []
        for group_index, group in enumerate(model.children()):
            self._layer_groups[group_index] = group
            self._layers.extend((group_index, leaf) for leaf in _leaf_modules(group))
        self.freeze_bn = freeze_batch_norms
        self.num_groups = len(self._layer_groups)

    def _index_pair(self, index: int) -> Tuple[int, int]:
        return index, index - self.num_groups

    def get_layer_groups(self) -> List[LayerGroup]:
        """Return the layer groups; a group is frozen when any of its parameters is."""
        return [
            LayerGroup(
                self._index_pair(index),
                module,
                any(not param.requires_grad for param in module.parameters()),
            )
            for index, module in self._layer_groups.items()
        ]

    def get_layers(self) -> List[Layer]:
        """Return the layers in order; a layer without parameters counts as frozen when it is
        in eval mode.

        :raises ValueError: a layer has both frozen and trainable parameters
        """
        layers = []
        for group_index, module in self._layers:
            states = {param.requires_grad for param in module.parameters(recurse=False)}
            if len(states) > 1:
                raise ValueError(
                    f"Layer {module.__class__.__name__} in layer group {group_index} has both "
                    "frozen and trainable parameters; freeze or unfreeze it as a whole."
                )
            is_frozen = (not states.pop()) if states else (not module.training)
            layers.append(Layer(self._index_pair(group_index), module, is_frozen))
        return layers

    def get_trainable_parameters(self) -> list:
        """Return the model's parameters that require gradients."""
        return [param for param in self.model.parameters() if param.requires_grad]

    def freeze(self, from_index=0, to_index=-2, set_modules_as_eval=False) -> None:
        """Freeze the layer groups from ``from_index`` to ``to_index`` inclusive (by default
        all but the last).

        :param set_modules_as_eval: also put the frozen layers in eval mode
        """
        self._set_state(from_index, to_index, freeze=True, set_mode=set_modules_as_eval)

    def unfreeze(self, from_index=-1, to_index=0, set_modules_as_training=True) -> dict:
        """Unfreeze the layer groups between the two indices inclusive (by default all).

        :param set_modules_as_training: also put the unfrozen layers in training mode
        :return: ``{group_index: {"params": [...]}}`` with the parameters made trainable, per
            layer group (positive index), ready to be added to an optimizer as parameter groups
        """
        return self._set_state(from_index, to_index, freeze=False, set_mode=set_modules_as_training)

    def _convert_idxs(self, from_index: int, to_index: int) -> Tuple[int, int]:
        """The two layer-group indices as non-negative indices, smaller first (pytorch-accelerated's
        name for this conversion)."""
        first, last = sorted((self._positive(from_index), self._positive(to_index)))
        return first, last

    def _set_state(self, from_index: int, to_index: int, freeze: bool, set_mode: bool) -> dict:
        first, last = self._convert_idxs(from_index, to_index)
        changed: Dict[int, list] = {}
        for layer in self.get_layers():
            group_index = layer.layer_group_idx[0]
            if group_index < first:
                continue
            if group_index > last:
                break
            if layer.is_frozen == freeze:
                continue
            if _module_is_batch_norm(layer.module) and not self.freeze_bn:
                continue
            params = list(layer.module.parameters())
            for param in params:
                param.requires_grad = not freeze
            if set_mode:
                layer.module.train(mode=not freeze)
            if params:
                changed.setdefault(group_index, []).extend(params)
        return {index: {"params": params} for index, params in changed.items()}

    def _positive(self, index: int) -> int:
        return index + self.num_groups if index < 0 else index

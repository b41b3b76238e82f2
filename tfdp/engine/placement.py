"""One way to replicate any model Keras can build: its variables placed for a mode.

Keras trains a model under a `tf.distribute` strategy when its variables were
made in the strategy's scope: each Keras variable then holds a distributed
`tf.Variable` (mirrored for weights, sync-on-read for metrics). `Placement` does
that to a model that already exists, whatever its kind (Functional, Sequential,
subclassed, a Keras `Trainer` that is a layer): inside it, every variable of the
model, its metrics and its optimizer holds a new `tf.Variable` made in the
strategy's scope (or on one device), with the same value, aggregation and
synchronization Keras gave it. The model object, its layers and its optimizer
stay the user's, so its own `train_step`, callbacks holding it and checkpoints
of it see one model. On leaving, the values go back into the variables the
model had before, and the object is as Keras left it, with the trained weights.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdp import internals
from tfdp.errors import ConfigError


def optimizers_of(model) -> list:
    """The model's optimizer and the ones it holds: the one loss scaling wraps, a
    MultiOptimizer's own."""
    found, waiting = [], [getattr(model, "optimizer", None)]
    while waiting:
        optimizer = waiting.pop(0)
        if optimizer is None or any(optimizer is f for f in found):
            continue
        found.append(optimizer)
        waiting.append(getattr(optimizer, "inner_optimizer", None))
        waiting.extend(internals.inner_optimizers(optimizer))
    return found


def variables_of(model) -> list:
    """Every Keras variable of the model, its metrics and its optimizers, once each."""
    seen, variables = set(), []
    groups = [model.variables, model.metrics_variables]
    groups += [optimizer.variables for optimizer in optimizers_of(model)]
    for group in groups:
        for variable in group:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


def raw_variables(model) -> list[str]:
    """The model's tf.Variables that are not Keras variables (made outside `add_weight`),
    as `layer.attribute` names: Keras does not know them, so they cannot be made again."""
    found = []
    for layer in internals.layers_of(model):
        for name, value in vars(layer).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, tf.Variable) for v in values):
                found.append(f"{layer.name}.{name}")
    return found


def check_no_raw_variables(model) -> None:
    """ConfigError naming the tf.Variables a strategy cannot mirror (`raw_variables`)."""
    found = raw_variables(model)
    if found:
        raise ConfigError(
            "model",
            model.name,
            f"holds a tf.Variable made outside Keras ({', '.join(found)}): it cannot be "
            "made again on every device; make it with layer.add_weight, or train in mode "
            "single, which keeps it where it is",
        )


class Placement:
    """The model's variables made again in `strategy`'s scope, or on `device`.

    Use as a context manager, or `enter()` and `exit()`. While placed, the model's
    `distribute_strategy` is the strategy (Keras' loss scaling and optimizer read
    it) and its compiled functions are cleared (Keras makes them again).
    """

    def __init__(self, model, strategy=None, device=None):
        self.model = model
        self.strategy = strategy
        self.device = device
        self.saved = None

    def __enter__(self):
        self.enter()
        return self

    def __exit__(self, *exc):
        self.exit()

    def enter(self) -> None:
        model = self.model
        if self.strategy is not None and self.strategy.num_replicas_in_sync > 1:
            check_no_raw_variables(model)  # (one replica uses them where they are)
        variables = variables_of(model)
        self.saved = {
            "values": [(v, internals.variable_value(v)) for v in variables],
            "strategy": internals.model_strategy(model),
            "optimizers": [(o, internals.optimizer_strategy(o)) for o in optimizers_of(model)],
        }
        keys = _keys(model, variables)
        scope = self.strategy.scope() if self.strategy else tf.device(self.device)
        with scope:
            for variable in variables:
                _remake(variable, _value_of(variable))
        internals.set_model_strategy(model, self.strategy)
        for optimizer in optimizers_of(model):
            internals.set_optimizer_strategy(
                optimizer, self.strategy or tf.distribute.get_strategy()
            )
        _rekey(model, variables, keys)
        _clear_functions(model)

    def exit(self) -> None:
        """The trained values back into the variables the model had before."""
        if self.saved is None:
            return
        model, saved = self.model, self.saved
        self.saved = None
        values = [(v, _value_of(v), original) for v, original in saved["values"]]
        variables = [v for v, _ in saved["values"]]
        keys = _keys(model, variables)
        original_strategy = saved["strategy"]
        scope = original_strategy.scope() if original_strategy else contextlib.nullcontext()
        with scope:
            for variable, value, original in values:
                internals.set_variable_value(variable, original)
                original.assign(tf.cast(value, original.dtype))
        internals.set_model_strategy(model, original_strategy)
        for optimizer, strategy in saved["optimizers"]:
            internals.set_optimizer_strategy(optimizer, strategy)
        _rekey(model, variables, keys)
        _clear_functions(model)


def outside_strategy_scopes():
    """Inside: no tf.distribute strategy scope the caller entered is current (a script
    that calls tfdp.fit within `strategy.scope()`): the mode's own strategy, or none,
    decides where the model trains."""
    return internals.outside_strategy_scopes()


@contextlib.contextmanager
def kept(variables):
    """Inside: `variables` may change; afterwards each holds its value of before again, on
    every replica of this process (read and put back replica by replica: no collective)."""
    saved = []
    for variable in variables:
        value = internals.variable_value(variable)
        parts = getattr(value, "values", None)
        if not isinstance(value, tf.distribute.DistributedValues) or not parts:
            parts = (value,)
        saved.append([(part, tf.identity(part.read_value())) for part in parts])
    try:
        yield
    finally:
        for parts in saved:
            for part, old in parts:
                part.assign(old)


def _value_of(variable):
    """A Keras variable's current value as one tensor: a mirrored variable's (they are
    equal), a sync-on-read variable's aggregate over this process's replicas (a metric's
    total). Only this process's replicas are read: reading a sync-on-read variable
    across a cluster is a collective, which every worker would have to join."""
    value = internals.variable_value(variable)
    with tf.device("/cpu:0"):
        components = getattr(value, "values", None)
        if not isinstance(value, tf.distribute.DistributedValues) or not components:
            return tf.identity(value)
        parts = [tf.identity(c.read_value()) for c in components]
        on_read = value.synchronization == tf.VariableSynchronization.ON_READ
        if on_read and value.aggregation == tf.VariableAggregation.SUM:
            return tf.add_n(parts)
        if on_read and value.aggregation == tf.VariableAggregation.MEAN:
            return tf.add_n(parts) / len(parts)
        return parts[0]


def _remake(variable, value) -> None:
    """The Keras variable holds a new tf.Variable of `value`, made where the caller's
    scope says, with the aggregation and synchronization Keras gave it."""
    internals.make_variable_again(variable, value)


def _keys(model, variables) -> dict:
    """Each optimizer's key of each variable (Keras' optimizers find a variable by its
    tf.Variable's id), before the variables are made again."""
    return {
        id(optimizer): {id(v): internals.optimizer_key(optimizer, v) for v in variables}
        for optimizer in optimizers_of(model)
    }


def _rekey(model, variables, before) -> None:
    """The optimizers' tables keyed by a variable's old key, keyed by its new one."""
    for optimizer in optimizers_of(model):
        old = before[id(optimizer)]
        new = {old[id(v)]: internals.optimizer_key(optimizer, v) for v in variables}
        internals.rekey_optimizer(optimizer, new)


def _clear_functions(model) -> None:
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


__all__ = ["Placement", "keras", "variables_of"]

"""Property-based tests for data-parallel training: this project's, torch's, and yours.

Installed with the package (from a clone: ``pip install "./ddp-reducer[testing]"`` adds
Hypothesis and pytest). It holds what the project's own property suite is built on:

- :mod:`~reducer.testing.reference`: the exact rank-order average a reduced gradient must
  equal on the fake world (``rank_order_average``), with torch's rounding or the bare
  reducer's (``scaling``);
- :mod:`~reducer.testing.model`, :mod:`~reducer.testing.strategies`: random models described
  by plain data, and Hypothesis strategies for models, bucket assignments, world sizes,
  unused-parameter patterns and whole reducer scenarios;
- :mod:`~reducer.testing.harness`: plays a reducer scenario on the fake world and checks it
  against the reference (``check_against_reference``);
- :mod:`~reducer.testing.checks`: checks for any data-parallel wrapper built from (module,
  process group): ``check_data_parallel`` (torch's DDP, this project's, FSDP2, your own;
  with your training step, optimizer and micro-batches) and ``check_comm_hook`` (exact in
  any of torch's roundings, or within a bound you state), on :class:`TrainingScenario`
  values that ``training_scenarios`` draws from your model factory and inputs; a mismatch
  is diagnosed (:mod:`reducer._averages`, shared with ``launch``'s replica check);
- :mod:`~reducer.testing.algorithms`: references as algorithms: what each rank must hold
  after each step (DDP's average, ZeRO, local SGD, hierarchical averaging, FSDP2's shards
  per rank, your own);
- ``check_same_training`` (from :mod:`reducer.testing.sametrain`): whether a data-parallel step
  trains what one process would on the global batch (the ranks' step replayed as one
  process, and the mistakes that keep ranks in sync named: summed loss, accumulation
  scale, uneven batches, per-rank BatchNorm, same batches); ``deliberate`` declares a
  choice on purpose;
- :mod:`~reducer.testing.schedule`: races made repeatable: ``schedules`` draws the fake
  world's schedule for the checks' ``schedule=``, ``race_report`` prints it as a timeline.

This module is a tool layer: it imports the core and ``fakepg``; the core never imports it.
Importing it registers nothing (see :mod:`reducer.testing.plugin` for the pytest plugin).
"""

from __future__ import annotations

from .algorithms import (
    Reference,
    StepGradients,
    ddp_average,
    fsdp2_shard,
    fsdp2_shards,
    hierarchical_averaging,
    periodic_averaging,
    zero_redundancy,
)
from .checks import (
    Batch,
    CheckReport,
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    fsdp2,
    reducer_ddp,
    sum_of_squares,
    torch_ddp,
)
from .harness import Scenario, check_against_reference
from .reference import rank_order_average, sparse_average, sum_then_divide
from .sametrain import Verdict, check_same_training, deliberate
from .schedule import fewest_deviations, race_report, schedules
from .strategies import bucket_caps_mb, generated_training_scenarios, training_scenarios

__all__ = [
    "TrainingScenario",
    "Batch",
    "CheckReport",
    "check_data_parallel",
    "check_comm_hook",
    "torch_ddp",
    "reducer_ddp",
    "fsdp2",
    "sum_of_squares",
    "Reference",
    "StepGradients",
    "ddp_average",
    "zero_redundancy",
    "fsdp2_shards",
    "fsdp2_shard",
    "periodic_averaging",
    "hierarchical_averaging",
    "training_scenarios",
    "generated_training_scenarios",
    "bucket_caps_mb",
    "Scenario",
    "check_against_reference",
    "rank_order_average",
    "sum_then_divide",
    "sparse_average",
    "schedules",
    "race_report",
    "check_same_training",
    "deliberate",
    "Verdict",
    "fewest_deviations",
]

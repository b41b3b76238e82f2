"""Splitting the global batch by measured device speed, and keeping it balanced.

The tutorial asks for each device's power and keeps the split fixed. Here:

  * auto powers: each device, alone, runs a few forward and backward passes on
    a probe shard; its power is the examples per second it managed
    (`powers_from_seconds`), and the powers give a first split. Then all
    devices run at once on their shares of a global batch, and the split
    is corrected under load (`settle_under_load`).
  * rebalancing: during training every step measures how long each device
    took for its shard; at the end of each window of K steps (shorter at the
    start of a run) the `Rebalancer` moves the shares part of the way toward
    the split under which all devices would finish together.

A device's time is modelled as proportional to its shard. Then the split that
equalises finishing times gives each device a share proportional to its rate
(examples per second at the current shares); moving only part of the way
(damping) and leaving splits alone whose times already agree within a
tolerance keep measurement noise from making the split oscillate. Once a
device has been measured at two splits far enough apart, its time is the
line through them instead, a fixed cost per step plus a time per example
(`affine_times`); once the noise is measured too, the line fitted to the
run's latest splits, as steep as the noise leaves possible (`fitted_times`).
A device that shares its cores with the others gets a nearly flat line
there: the examples it gives up are computed on its cores anyway.

Once the devices' step-to-step noise is measured, the target is the split
with the shortest *expected* step (`fastest_shares`), not equal mean times:
a step lasts as long as its slowest device, and when every device's time
scatters, equal means leave each device the slowest half of the time. An
example moved off a slow device saves more time than it costs a fast one,
so the fastest expected step gives slow devices a little less. Without
noise the two targets are the same split.

Pure Python (a trainer is used through its probes, tensors read with
float()): the training loop, tfdp-bench and the tests' cost model
(tests/cost_model.py) run the same code.

    arithmetic.py   the arithmetic of a split: shares, time lines, the target
    rebalancing.py  what measures devices and re-splits during a run
    leaving.py      leaving out a device that only slows the step, and taking it back
"""

from tfdp.balance.rebalancing import (  # noqa: F401
    Rebalancing,
    calibrate_slowdown,
    measure_powers,
    seconds_alone,
    settle_under_load,
)
from tfdp.balance.arithmetic import (  # noqa: F401
    DAMPING,
    FIT_ERROR,
    FIT_SPLITS,
    FLAT_SLOPE,
    MIN_FIT_CHANGE,
    MIN_MOVE,
    MIN_SCATTER,
    PROBE_WINDOW,
    PROBE_WINDOWS,
    TOLERANCE,
    Rebalancer,
    affine_times,
    beyond_noise,
    departures,
    expected_slowest,
    fastest_shares,
    fitted_times,
    imbalance,
    powers_from_seconds,
    whole_shares,
    window_scatter,
)

import io

from tfdp.run.observe import Progress, format_duration


class FakeClock:
    """Seconds that pass only when the test says so (any origin: a clock's is arbitrary)."""

    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_progress_line_is_rewritten_in_place():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(total_steps=200, batch_size=100, first_step=100, stream=stream, clock=clock)
    clock.advance(10.0)  # 50 steps in 10 s: 5 steps/s x 100 = 500 images/s; 50 left: 10 s
    progress.update(150, {"loss": 0.25, "accuracy": 0.93})
    progress.clear()
    clock.advance(0.2)  # 51 steps in 10.2 s: still 5 steps/s; 49 left: 9.8 s, shown as 9
    progress.update(151, {"loss": 0.24, "accuracy": 0.94}, force=True)
    progress.close()
    first = "step 150/200 | loss 0.2500 | accuracy 0.9300 | 500 images/s | ETA 0:00:10"
    second = "step 151/200 | loss 0.2400 | accuracy 0.9400 | 500 images/s | ETA 0:00:09"
    blank = " " * len(first)
    assert stream.getvalue() == "\r" + first + "\r" + blank + "\r" + "\r" + second + "\n"


def test_the_rate_counts_only_the_steps_of_this_run():
    stream, clock = io.StringIO(), FakeClock(now=0.0)
    progress = Progress(total_steps=1000, batch_size=32, first_step=400, stream=stream, clock=clock)
    clock.advance(4.0)  # 40 steps in 4 s: 10 steps/s x 32 = 320 images/s; 560 left: 56 s
    progress.update(440, {"loss": 1.0})
    assert stream.getvalue() == "\rstep 440/1000 | loss 1.0000 | 320 images/s | ETA 0:00:56"


def test_progress_is_throttled():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(total_steps=10, batch_size=100, stream=stream, interval=60, clock=clock)
    read = []

    def metrics():
        read.append(True)
        return {"loss": 1.0}

    progress.update(1, metrics)  # the first update is shown
    clock.advance(59.0)
    progress.update(2, metrics)  # 59 s after the last one shown: within the interval
    clock.advance(1.0)
    progress.update(3, metrics)  # 60 s after: shown
    clock.advance(1.0)
    progress.update(4, metrics, force=True)  # forced: shown within the interval
    lines = stream.getvalue().split("\r")[1:]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/10", "step 3/10", "step 4/10"]
    assert len(read) == 3  # a step's metrics are read (waiting for the device) only when shown
    # Step 3 at 60 s: 3 steps/60 s x 100 = 5 images/s, 7 steps left: 140 s.
    assert lines[1].rstrip().endswith("| 5 images/s | ETA 0:02:20")


def test_format_duration():
    assert format_duration(3725.9) == "1:02:05"

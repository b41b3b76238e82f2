import io

from tfdp.observe import Progress, format_duration


def test_progress_line_is_rewritten_in_place():
    stream = io.StringIO()
    progress = Progress(total_steps=200, batch_size=100, first_step=100, stream=stream)
    progress.start_time -= 10.0  # 50 steps in 10 s: 5 steps/s, 500 images/s
    progress.update(150, {"loss": 0.25, "accuracy": 0.93})
    progress.clear()
    progress.update(151, {"loss": 0.24, "accuracy": 0.94}, force=True)
    progress.close()
    text = stream.getvalue()
    first = "step 150/200 | loss 0.2500 | accuracy 0.9300 | 500 images/s | ETA 0:00:10"
    assert text.startswith("\r" + first)
    assert "\r" + " " * len(first) + "\r" in text  # cleared for a log line
    assert text.endswith("ETA 0:00:09\n") or text.endswith("ETA 0:00:10\n")


def test_progress_is_throttled():
    stream = io.StringIO()
    progress = Progress(total_steps=10, batch_size=1, stream=stream, interval=60)
    progress.update(1, {"loss": 1.0, "accuracy": 1.0})
    progress.update(2, {"loss": 1.0, "accuracy": 1.0})  # within the interval: not shown
    assert stream.getvalue().count("step ") == 1


def test_format_duration():
    assert format_duration(3725.9) == "1:02:05"

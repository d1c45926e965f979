"""The ranks from a real Jupyter kernel (jupyter_client, fresh kernel): what a
notebook receives on iopub (labelled lines, the monitor's memory view: live, then its image), a
real kernel interrupt (``interrupt_kernel``) interrupting the ranks, and a
kernel shutdown leaving no rank behind."""

from __future__ import annotations

import contextlib
import time

import psutil
import pytest

from support import kernel_errors, kernel_run, kernel_stdout, started_kernel, started_torch_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@contextlib.contextmanager
def kernel_with_torch_ranks():
    """A fresh kernel running 2 torch ranks: yields ``(manager, client)``. At the end a graceful
    shutdown, as the notebook's "Shut down kernel" does: the kernel exits and its atexit stops the
    ranks; then none of the ranks' first processes may be left."""
    pids: list[int] = []
    with started_kernel(graceful=True) as (km, kc):
        pids = started_torch_ranks(kc)
        yield km, kc
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    assert pids and [p for p in pids if psutil.pid_exists(p)] == []


def test_ranks_from_a_real_kernel_interrupt_and_shutdown(tmp_path):
    with kernel_with_torch_ranks() as (km, kc):
        reply = kernel_run(
            kc,
            "%%vgpu_run\nimport os, time\nfor step in range(3):\n"
            "    print('step', step, 'on', os.environ['RANK'])\n    time.sleep(0.3)",
        )
        assert not kernel_errors(reply), kernel_errors(reply)
        lines = kernel_stdout(reply).splitlines()
        assert [x for x in lines if x.startswith("[rank 1]")] == [f"[rank 1] step {s} on 1" for s in range(3)]
        displays = [m for m in reply if m["msg_type"] == "display_data"]
        updates = [m for m in reply if m["msg_type"] == "update_display_data"]
        # The monitor's one memory view: the live widget, then the final image in its place.
        assert len(displays) == 1 and "application/vnd.jupyter.widget-view+json" in displays[0]["content"]["data"]
        shown = displays[0]["content"]["transient"]["display_id"]
        assert [m["content"]["transient"]["display_id"] for m in updates] == [shown]
        final = updates[0]["content"]["data"]
        assert "image/png" in final and final["text/plain"].startswith("memory · %%vgpu_run")
        assert "rank 0 RSS: now" in final["text/plain"] and "rank 1 RSS: now" in final["text/plain"]

        # Issue 22, defect 5: what a rank displays reaches the notebook as itself, after a line naming its rank.
        reply = kernel_run(
            kc, "%%vgpu_run --no-plot\nfrom IPython.display import HTML, display\ndisplay(HTML('<b>x</b>'))"
        )
        shown = [m["content"] for m in reply if m["msg_type"] == "display_data"]
        assert sorted(c["metadata"]["rank"] for c in shown) == [0, 1]
        assert {c["data"]["text/html"] for c in shown} == {"<b>x</b>"}
        assert sorted(x for x in kernel_stdout(reply).splitlines() if x.startswith("[rank")) == ["[rank 0]", "[rank 1]"]

        sent: list[bool] = []

        def interrupt_once_running(msg: dict) -> None:
            if not sent and msg["msg_type"] == "stream" and "sleeping" in msg["content"]["text"]:
                sent.append(True)
                km.interrupt_kernel()

        reply = kernel_run(
            kc,
            "%%vgpu_run --no-plot\nimport time\nprint('sleeping', flush=True)\ntime.sleep(120)",
            on_message=interrupt_once_running,
        )
        assert [e.split(":")[0] for e in kernel_errors(reply)] == ["KeyboardInterrupt"]
        # Both ranks came back from the interrupt: the same cluster runs the next cell.
        reply = kernel_run(kc, "%%vgpu_run -o alive --no-plot\n'yes'\n")
        assert not kernel_errors(reply), kernel_errors(reply)
        reply = kernel_run(kc, "print(alive)")
        assert kernel_stdout(reply).strip() == "['yes', 'yes']"

        # Issue 37, row 12: a script run's view said "%%vgpu_run", and "interrupted" when a rank failed.
        script = tmp_path / "fails.py"
        script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n")
        reply = kernel_run(kc, f"%vgpu_run {script}")
        assert [e.split(":")[0] for e in kernel_errors(reply)] == ["RankRunError"]
        final = [m for m in reply if m["msg_type"] == "update_display_data"][-1]["content"]["data"]["text/plain"]
        assert final.startswith("memory · %vgpu_run · ") and final.splitlines()[0].endswith(" s · rank 1 failed")


def test_a_dead_rank_is_reported_with_its_exit_status_from_a_real_kernel():
    """Issue 16, defect 4: in a kernel, ipyparallel had already dropped the dead engine's launcher when
    its status was read, so every death said "died (exit status unknown)"."""
    with kernel_with_torch_ranks() as (_km, kc):
        deaths = (("os._exit(3)", "exited with status 3"), ("os.kill(os.getpid(), 9)", "was killed by SIGKILL"))
        for death, said in deaths:
            cell = f"import os, time\nif os.environ['RANK'] == '1':\n    {death}\ntime.sleep(30)"
            reply = kernel_run(kc, f"%%vgpu_run --no-plot --timeout 60\n{cell}")
            [error] = kernel_errors(reply)
            assert error.startswith(f"RankRunError: rank 1 {said} (pid "), error
            reply = kernel_run(kc, "%vgpu_cluster restart")
            assert not kernel_errors(reply), kernel_errors(reply)
        reply = kernel_run(kc, "%vgpu_cluster stop")


WIDGET = "application/vnd.jupyter.widget-view+json"


def rank_events(reply: list[dict], rank: int) -> list[str]:
    """What the notebook got from ``rank``, in order: each line it printed, and ``display:TEXT`` for each
    display (the ``[rank r]`` line that announces a display left out)."""
    events = []
    for msg in reply:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            label = f"[rank {rank}] "
            events += [line[len(label) :] for line in msg["content"]["text"].splitlines() if line.startswith(label)]
        elif msg["msg_type"] == "display_data" and msg["content"]["metadata"].get("rank") == rank:
            events.append("display:" + msg["content"]["data"].get("text/plain", ""))
    return events


def test_a_ranks_progress_bar_is_live_and_its_displays_keep_their_order_in_a_notebook(tmp_path):
    """Issue 22, defect 5: a tqdm.auto bar on rank 0 (the engines are kernels: tqdm picks its widget, and
    ipyparallel relays the widget's messages) showed as a static "0%" line, its widget left out; Keras'
    model.summary() (rich's displays) and prints arrived in another order than the rank made them."""
    shown = tmp_path / "bar-shown"
    bar = (
        "%%vgpu_run --no-plot\nimport os, time, tqdm.auto\nif os.environ['RANK'] == '0':\n"
        "    bar = tqdm.auto.tqdm(total=3)\n    deadline = time.monotonic() + 30\n"
        f"    while not os.path.exists({str(shown)!r}) and time.monotonic() < deadline:\n        time.sleep(0.05)\n"
        "    for _ in range(3):\n        bar.update(1)\n    bar.close()\nprint('done')\n"
    )

    def touch_once_the_bar_shows(msg: dict) -> None:
        if msg["msg_type"] == "display_data" and WIDGET in msg["content"]["data"]:
            shown.touch()

    with kernel_with_torch_ranks() as (_km, kc):
        reply = kernel_run(kc, bar, on_message=touch_once_the_bar_shows)
        assert not kernel_errors(reply), kernel_errors(reply)
        bars = [m for m in reply if m["msg_type"] == "display_data" and WIDGET in m["content"]["data"]]
        assert [m["content"]["metadata"]["rank"] for m in bars] == [0]
        models = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in reply if m["msg_type"] == "comm_open"}
        box = models[bars[0]["content"]["data"][WIDGET]["model_id"]]
        [progress] = [c[len("IPY_MODEL_") :] for c in box["children"] if models[c[len("IPY_MODEL_") :]].get("max") == 3]
        values = [
            (reply.index(m), m["content"]["data"]["state"]["value"])
            for m in reply
            if m["msg_type"] == "comm_msg"
            and m["content"]["comm_id"] == progress
            and "value" in m["content"]["data"].get("state", {})
        ]
        # The bar was in the notebook before it moved (rank 0 waited for it), and its updates reached it.
        assert values and values[-1][1] == 3 and reply.index(bars[0]) < values[0][0]

        summary = (
            "%%vgpu_run --no-plot\nimport os\nos.environ['KERAS_BACKEND'] = 'torch'\nimport keras\n"
            "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name='dense_probe')])\n"
            "print('before')\nmodel.summary()\nprint('after')\n"
        )
        reply = kernel_run(kc, summary)
        assert not kernel_errors(reply), kernel_errors(reply)
        for rank in range(2):
            events = rank_events(reply, rank)
            assert events[0] == "before" and events[-1] == "after", events
            assert all(event.startswith("display:") for event in events[1:-1])
            text = "".join(events[1:-1])
            assert "dense_probe" in text and "Total params" in text

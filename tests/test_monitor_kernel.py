"""The live plot inside a real Jupyter kernel (jupyter_client, fresh kernel).

What a notebook receives on iopub: one ``display_data`` with a display id,
then only ``update_display_data`` for that id (no growing list of outputs),
every frame an ``image/png``; the final frame, drawn when the cell ends, says
the run is done, or interrupted after a real kernel interrupt.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import time

import pytest

from conftest import CHILD_ENV, ROOT

pytestmark = pytest.mark.slow

SETUP = """
import json, time
import numpy as np
import vgpu_magic
%load_ext vgpu_magic
%vgpu_split 2 --quiet
import keras

class Pace(keras.callbacks.Callback):
    # Makes each step last >= 10 ms so the run is long enough for live frames.
    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(0.01)

with vgpu_magic.strategy().scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(1600, 16)).astype("float32")  # 100 steps of 16
y = rng.integers(0, 4, 1600)
"""


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    env = {**CHILD_ENV, "PYTHONPATH": str(ROOT)}
    env.pop("MPLBACKEND", None)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    try:
        # the kernel must be this interpreter, with vgpu_magic importable
        reply = run(kc, "import sys; print(sys.executable)")
        assert stream_text(reply).strip() == sys.executable
        reply = run(kc, SETUP, timeout=180)
        assert not errors(reply), errors(reply)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc, code: str, timeout: float = 240, on_message=None) -> list[dict]:
    """Execute ``code``; return the iopub messages of that request, up to idle."""
    msg_id = kc.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


def stream_text(messages: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")


def errors(messages: list[dict]) -> list[str]:
    return [f"{m['content']['ename']}: {m['content']['evalue']}" for m in messages if m["msg_type"] == "error"]


def displays(messages: list[dict]) -> list[tuple[str, str | None, dict]]:
    return [
        (m["msg_type"], m["content"].get("transient", {}).get("display_id"), m["content"]["data"])
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
    ]


def png_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def check_one_output_updated_in_place(messages: list[dict], final_word: str) -> int:
    shown = displays(messages)
    assert shown, "no display messages"
    kinds = [kind for kind, _, _ in shown]
    assert kinds[0] == "display_data" and kinds.count("display_data") == 1, kinds
    display_id = shown[0][1]
    assert display_id
    assert all(did == display_id for _, did, _ in shown)
    for _, _, data in shown:
        width, height = png_size(data["image/png"])
        assert width > 400 and height > 200
    final = shown[-1][2]["text/plain"]
    assert final.startswith("memory · fit") and final_word in final.splitlines()[0], final
    assert "host memory (shared by 2 logical CPUs)" in final
    return kinds.count("update_display_data")


def test_fit_shows_one_plot_updated_in_place(kernel):
    km, kc = kernel
    messages = run(kc, "mon = vgpu_magic.MemoryMonitor()\n"
                       "model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[mon, Pace()])\n"
                       "print(json.dumps({'samples': len(mon.trace), 'frames': len(mon.view.draw_costs)}))")
    assert not errors(messages), errors(messages)
    updates = check_one_output_updated_in_place(messages, "done")
    assert updates >= 2  # at least one live frame, and the final one
    result = json.loads(stream_text(messages).strip().splitlines()[-1])
    # When the cell printed, fit had shown the first frame and its live
    # updates; the final frame came after, at the end of the cell.
    assert result["frames"] == updates and result["samples"] >= 10
    kinds = [m["msg_type"] for m in messages if m["msg_type"] in ("stream", "update_display_data")]
    assert kinds[-1] == "update_display_data" and "stream" in kinds


def test_vgpu_monitor_on_plots_a_fit_without_code_changes(kernel):
    km, kc = kernel
    messages = run(kc, "%vgpu_monitor on\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[Pace()])")
    assert not errors(messages), errors(messages)
    check_one_output_updated_in_place(messages, "done")
    messages = run(kc, "%vgpu_monitor off\nmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)")
    assert displays(messages) == []


def test_interrupting_the_kernel_keeps_the_trace_and_a_final_frame(kernel):
    km, kc = kernel
    interrupted = []

    def interrupt_once_plotting(msg):
        if msg["msg_type"] == "display_data" and not interrupted:
            interrupted.append(True)
            km.interrupt_kernel()

    messages = run(
        kc,
        "mon = vgpu_magic.MemoryMonitor()\n"
        "model.fit(x, y, batch_size=16, epochs=1000, verbose=0, callbacks=[mon, Pace()])",
        on_message=interrupt_once_plotting,
    )
    assert interrupted and [e.split(":")[0] for e in errors(messages)] == ["KeyboardInterrupt"]
    check_one_output_updated_in_place(messages, "interrupted")
    after = run(kc, "print(json.dumps({'samples': len(mon.trace), 'interrupted': mon.trace.interrupted, "
                    "'active': mon.active}))")
    result = json.loads(stream_text(after).strip().splitlines()[-1])
    assert result["samples"] >= 5 and result["interrupted"] and not result["active"]

import subprocess
import sys

from coconet.server.driver import Driver, gone, this_process


def test_this_process_is_not_gone():
    me = this_process()
    assert me is not None and Driver.parse(me.text) == me
    assert gone(me.text) is None


def test_an_ended_process_is_gone_and_a_reused_pid_is_not_it():
    me = this_process()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            start = f.read().rsplit(")", 1)[-1].split()[19]
        running = Driver(me.host, me.machine, child.pid, start)
        assert gone(running.text) is None
        # the same pid, started at another time: another process, so the driver is gone
        assert gone(Driver(me.host, me.machine, child.pid, str(int(start) + 1)).text) is not None
    finally:
        child.stdin.close()
        child.wait()
    assert gone(running.text) == running


def test_of_a_driver_elsewhere_or_unnamed_nothing_is_known():
    me = this_process()
    ended = Driver(me.host, me.machine, 2**22 + 1, "1")  # above the kernel's pid_max default: no such process
    assert gone(ended.text) == ended
    assert gone(Driver("another-host", me.machine, ended.pid, "1").text) is None
    assert gone(Driver(me.host, "another-boot/pid:[1]", ended.pid, "1").text) is None
    for text in (None, "", "not a driver", "x@host boot 1"):
        assert gone(text) is None

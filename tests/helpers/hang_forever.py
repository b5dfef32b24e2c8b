"""A program that hangs in two processes, parent and forked child, each in `wait_forever`; it writes the child's
pid to the file argv[1] once both exist. For the test of the suite's report on a hung process (tests/helpers/hung.py)."""

import os
import sys
import threading


def wait_forever() -> None:
    threading.Event().wait()


if __name__ == "__main__":
    child = os.fork()
    if child == 0:
        wait_forever()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(child))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    wait_forever()

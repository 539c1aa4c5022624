"""A port someone else holds: what a launch meets when another process takes the port it chose."""

import socket


def hold_port(held: list) -> int:
    """A port listened on at every address (the group's store finds it taken on any), kept open in ``held``."""
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    held.append(s)
    return s.getsockname()[1]

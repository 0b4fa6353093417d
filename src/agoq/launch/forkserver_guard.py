"""The fork server's first import (agoq.launch.forkserver.FORKSERVER_PRELOAD): it makes the server
die with the launcher that started it, and leave quietly on a Ctrl-C. In any other process, where
the launcher's pid is not the parent's, importing it does nothing."""

from agoq.launch.forkserver import guard_fork_server

guard_fork_server()

"""The Unix-socket server: the listener and one session per protocol (MAGN, line protocol)."""

"""The wire protocols, sans-IO: MAGN frames and messages, the MAGN conversation, and the line protocol."""

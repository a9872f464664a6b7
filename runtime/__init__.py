"""What every gasloc process runs on: child-process lifecycle and supervision, config resolution, multiaddrs,
logging, the asyncio loop thread, and hivemind socket bookkeeping. Imports no gasloc component."""

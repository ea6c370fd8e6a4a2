"""The Agent Client Protocol client, usable on its own: wire types, JSON-RPC connection, child process."""

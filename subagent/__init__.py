"""subagent-seam: one AI agent delegates work to another."""

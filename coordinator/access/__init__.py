"""Who may call the coordinator: access rules per endpoint, tokens, rate limits, and the audit log of what happened."""

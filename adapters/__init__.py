"""Integrations of agentmem with agent frameworks."""

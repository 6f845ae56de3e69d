from agentmem.cli import app

app(prog_name="agentmem")

"""The staged ladder (`swinbench apply`): run a recipe stage by stage, gate, time, record, report."""

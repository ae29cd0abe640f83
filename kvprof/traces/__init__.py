"""Traces without a model: the trace format (`trace`), workflow specs (`spec`), tasks (`tasks`), chat templates and
chat-log import (`chat`, `chat_log`), shape-CSV import (`shapes`), stop strings (`stopping`) and what each turn could
reuse, derived from its exact ids (`reuse`)."""

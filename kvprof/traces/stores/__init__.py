"""Agent traces where teams keep them, read into the calls `kvprof import-chat` renders (`LoggedCall`s): OTLP JSON
with the OpenTelemetry GenAI conventions (`genai`) or OpenInference's (`openinference`), LangSmith run exports
(`langsmith`), OpenAI Agents SDK trace exports (`agents_sdk`, Responses API items in `responses`) and AG2's SQLite log
(`ag2`); `detect` tells them apart. docs/commands/import-traces.md shows each format."""

"""A verifiers v1 taskset written for the tests (--env verifiers:tests/vf_turns.py): two model turns per episode (the
task's prompt, then "Go on."), reward = the share of letters in the last reply. Offline: the harness runs its chat loop
in-process against the interception endpoint, on the local subprocess runtime. --env-args '{"taskset": {"fail":
"raise"}}' makes run() raise on task 1; "hang" makes it sleep past any timeout; "silent" makes its harness return
without calling the model (a trace without tokens)."""
import asyncio

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult, SubprocessConfig


class TurnsConfig(vf.TasksetConfig):
    size: int = 128
    fail: str = ""


class TurnsData(vf.TaskData):
    number: int = 0
    silent: bool = False


class TurnsTask(vf.Task[TurnsData, vf.State, vf.TaskConfig]):
    pass


class TurnsTaskset(vf.Taskset[TurnsTask, TurnsConfig]):
    def load(self):
        for i in range(self.config.size):
            silent = self.config.fail == "silent" and i == 1
            yield TurnsTask(TurnsData(prompt=f"Count from {i}.", number=i, silent=silent), self.config.task)


class TurnsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=SubprocessConfig())


class TurnsEnv(vf.Env[TurnsEnvConfig]):
    async def run(self, task, agents):
        fail = self.taskset.config.fail if task.data.number == 1 else ""
        if fail == "raise":
            raise RuntimeError(f"task {task.data.number} fails on purpose")
        if fail == "hang":
            await asyncio.sleep(3600)
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:  # (a turn cut by max_tokens ends the rollout: verifiers' stop condition)
                segment = await interaction.turn("Go on.")
        reply = segment.last_reply or ""
        interaction.trace.record_reward("letters", sum(c.isalpha() for c in reply) / max(1, len(reply)), 1.0)


class InProcessHarness(vf.Harness[vf.HarnessConfig]):
    """The model calls of one segment, made from this process through the interception endpoint (no program)."""
    APPENDS_SYSTEM_PROMPT = SUPPORTS_RESUME = True
    EXECUTES_CODE = NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        if data.silent:
            return ProgramResult(0, "", "")
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str)
            else [m.model_dump(mode="json", exclude_none=True) for m in prompt])
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(0, "", "")


__all__ = ["TurnsTaskset", "TurnsEnv", "InProcessHarness"]

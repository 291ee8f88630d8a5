"""An OpenEnv environment for the tests, served by openenv's own app (create_app) under uvicorn:
`python tests/openenv_for_tests.py PORT`. A letter-counting game: reset(letter=...) names a letter; each step's reward
is how often the action's message holds it (letter_reward); the observation's text says so (observation_text); the
episode is done after TURNS steps. reset(mode=...) makes the session misbehave in step(): `hang` sleeps past any test's
--rollout.env-timeout-s, `bad` sends an observation without text, `drop` closes the connection without an answer; `slow`
makes reset() itself answer after SLOW_RESET_S."""
import asyncio
import sys
import time

from openenv.core.env_server import Action, Environment, Observation, State, create_app

TURNS = 3
SLOW_RESET_S = 1.5


class LetterAction(Action):
    message: str


class LetterObservation(Observation):
    text: str | None = None
    turn: int = 0


def letter_reward(message, letter):
    return float(message.count(letter))


def observation_text(turn, letter, message):
    return f"turn {turn}: {message.count(letter)} x '{letter}'"


class LetterEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, letter="1", mode=None):
        if mode == "slow":
            time.sleep(SLOW_RESET_S)
        self._state, self.letter, self.mode = State(episode_id=episode_id, step_count=0), letter, mode
        return LetterObservation(text=f" Count the {letter}s.")

    def step(self, action, timeout_s=None, **_):
        self._state.step_count += 1
        turn = self._state.step_count
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "drop":  # not an Exception: openenv's handler lets it out and the connection closes
            raise asyncio.CancelledError
        text = None if self.mode == "bad" else observation_text(turn, self.letter, action.message)
        return LetterObservation(text=text, turn=turn, reward=letter_reward(action.message, self.letter),
                                 done=turn >= TURNS)

    @property
    def state(self):
        return self._state


app = create_app(LetterEnv, LetterAction, LetterObservation, env_name="letters", max_concurrent_envs=32)

if __name__ == "__main__":
    import uvicorn
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

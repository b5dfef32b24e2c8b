"""The gan recipe's task with the discriminator's loss made NaN at its first step: under trainer.nonfinite=skip
that step skips the discriminator's update and applies the generator's (a partial step, as fp16's overflow in one
part gives)."""

from trainer.recipes.gan.task import GANTask


class DiscriminatorNaN(GANTask):
    def training_step(self, step):
        calls = getattr(self, "_calls", 0) + 1
        self._calls = calls
        if calls == 1:
            real = step.optimizer_step

            def optimizer_step(name):
                if name == "discriminator":  # its gradients made NaN: this part's update is skipped
                    for p in step.model.parameters():
                        if p.grad is not None:
                            p.grad.fill_(float("nan"))
                return real(name)

            step.optimizer_step = optimizer_step
        return super().training_step(step)

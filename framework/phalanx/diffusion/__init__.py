"""What every diffusion recipe shares (apps/diffusion, apps/video_gen): timestep samplers, noise
targets and losses, classifier-free-guidance dropout, and validation media.

    from phalanx.diffusion import logit_normal_timesteps, shift_timesteps, flow_interpolate, flow_loss
    t = shift_timesteps(logit_normal_timesteps(b), resolution_shift(tokens, base_tokens=256))
    loss = flow_loss(model_out, x0, noise)            # rectified flow, velocity target

See docs/diffusion.md and docs/video.md.
"""
from phalanx.diffusion.guidance import drop_captions, guided_prediction
from phalanx.diffusion.media import image_grid, save_grid, save_gif, save_video, video_to_uint8
from phalanx.diffusion.objectives import (add_noise, epsilon_or_v_target, flow_interpolate, flow_loss,
                                          flow_velocity_target, min_snr_weights, per_sample_mse, snr)
from phalanx.diffusion.timesteps import (fixed_eval_timesteps, logit_normal_timesteps, resolution_shift,
                                         shift_timesteps, uniform_discrete_timesteps, uniform_timesteps)

__all__ = ["drop_captions", "guided_prediction", "image_grid", "save_grid", "save_gif", "save_video",
           "video_to_uint8", "add_noise", "epsilon_or_v_target", "flow_interpolate", "flow_loss",
           "flow_velocity_target", "min_snr_weights", "per_sample_mse", "snr", "fixed_eval_timesteps",
           "logit_normal_timesteps", "resolution_shift", "shift_timesteps", "uniform_discrete_timesteps",
           "uniform_timesteps"]

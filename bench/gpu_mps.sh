# Sourced by the device-call scripts (bench/gpu_call_sharing.sh, bench/gpu_call_acceptance.sh): with MPS=1, start
# a CUDA MPS server of this call's own (pipe and log folders under /tmp/mps; it quits when the script exits), so
# that the processes of the call share the GPU at once instead of taking turns on it. It changes no setting of
# the card. Sets mps=on, or mps=off with the reason printed (MPS not asked for, not on the image, or no start).
# A script with exit work of its own calls `mps_stop` from its EXIT trap (a new trap replaces this one).
mps=off
mps_stop() {
  [ "$mps" = on ] && echo quit | nvidia-cuda-mps-control
  return 0
}
if [ "${MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      mps=on
      trap mps_stop EXIT
      # a started control daemon does not prove clients work (a sandbox may refuse them): one tiny CUDA op
      if timeout 90 python3 -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4" 2> /tmp/mps/probe.err; then
        echo "MPS: on (the processes of this call share the GPU at once)"
      else
        echo "MPS: the server started but a CUDA op through it failed ($(tail -n 2 /tmp/mps/probe.err)): processes take turns on the GPU"
        mps_stop
        mps=off
        trap - EXIT
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi
    else
      echo "MPS: the server did not start ($(tail -n 3 /tmp/mps/log/control.log 2>/dev/null)): processes take turns on the GPU"
    fi
  else
    echo "MPS: no nvidia-cuda-mps-control on this image: processes take turns on the GPU"
  fi
fi

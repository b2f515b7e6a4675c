//! Device names, their parsing and the features that build them in.

use super::*;

/// What the missing-driver reasons rest on: a library that is there loads, one that is not
/// does not (and nothing crashes either way).
#[test]
fn a_shared_library_is_loadable_only_where_it_exists() {
    assert!(loadable(c"libc.so.6"));
    assert!(!loadable(c"libhearth-no-such-library.so.1"));
    // This machine's Vulkan loader is there (CI installs it), so no wgpu device is said to
    // lack it.
    #[cfg(feature = "wgpu")]
    if loadable(c"libvulkan.so.1") {
        assert_eq!(missing_driver(DeviceChoice::VulkanCpu), None);
    }
}

#[test]
fn every_device_of_the_build_names_its_burn_backend() {
    for &choice in DeviceChoice::ALL {
        let expected = match choice.burn_device_name() {
            // One cubecl runtime, wgpu's, whichever compiler it uses.
            "vulkan" => "wgpu",
            other => other,
        };
        let device = choice.device_unchecked();
        assert_eq!(burn_backend_name(&device), Some(expected), "{choice}");
        assert_eq!(
            burn_backend_name(&device.autodiff()),
            Some(expected),
            "{choice}, autodiff"
        );
    }
}

#[test]
fn unknown_device_lists_the_choices() {
    let err = "tpu".parse::<DeviceChoice>().unwrap_err().to_string();
    assert!(err.contains("'tpu'") && err.contains("flex"), "{err}");
}

/// A device Hearth has but this build left out names the feature that brings it, in every
/// build: the one the tests run (wgpu and ndarray, no CUDA) and the default one (none).
#[test]
fn a_device_left_out_of_the_build_names_its_feature() {
    for (name, feature) in [
        ("cuda", "cuda"),
        ("wgpu", "wgpu"),
        ("vulkan-cpu", "wgpu"),
        ("ndarray", "ndarray"),
    ] {
        match name.parse::<DeviceChoice>() {
            Ok(choice) => assert_eq!(choice.name(), name),
            Err(err) => {
                let err = err.to_string();
                assert!(
                    err.contains(&format!("'{name}'"))
                        && err.contains(&format!("--features {feature}"))
                        && err.contains("flex"),
                    "{err}"
                );
            }
        }
    }
    #[cfg(not(feature = "cuda-device"))]
    assert!("cuda".parse::<DeviceChoice>().is_err());
    // Every optional device is either built in or listed as left out, never both.
    for (name, _) in OPTIONAL_DEVICES {
        let built = DeviceChoice::ALL.iter().any(|d| d.name() == name);
        let listed = DeviceChoice::left_out().iter().any(|(n, _)| *n == name);
        assert!(
            built != listed,
            "{name}: built {built}, listed as left out {listed}"
        );
    }
}

#[test]
fn names_round_trip() {
    for d in DeviceChoice::ALL {
        assert_eq!(d.name().parse::<DeviceChoice>().unwrap(), *d);
    }
    assert_eq!("FLEX".parse::<DeviceChoice>().unwrap(), DeviceChoice::Flex);
}

#[test]
fn gpu_indices_parse_and_follow_the_local_rank() {
    let flex: DeviceSpec = "flex".parse().unwrap();
    assert_eq!(flex.for_local_rank(Some(3)), flex, "CPU devices are shared");
    assert!(
        "flex:1"
            .parse::<DeviceSpec>()
            .unwrap_err()
            .to_string()
            .contains("no device index")
    );
    assert!(
        "flex:x"
            .parse::<DeviceSpec>()
            .unwrap_err()
            .to_string()
            .contains("GPU index")
    );
    #[cfg(feature = "wgpu")]
    {
        let v: DeviceSpec = "vulkan".parse().unwrap();
        assert_eq!(v.for_local_rank(Some(1)).to_string(), "vulkan:1");
        assert_eq!(v.for_local_rank(None).to_string(), "vulkan");
        let pinned: DeviceSpec = "wgpu:0".parse().unwrap();
        assert_eq!(pinned.for_local_rank(Some(1)).to_string(), "wgpu:0");
        let cpu: DeviceSpec = "vulkan-cpu".parse().unwrap();
        assert_eq!(cpu.for_local_rank(Some(1)).to_string(), "vulkan-cpu");
    }
}

#[test]
fn cpu_devices_work() {
    select("flex").unwrap();
    #[cfg(feature = "ndarray")]
    select("ndarray").unwrap();
}

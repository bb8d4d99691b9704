//! A world of latencies for the simulations: nodes in six regions of cities, each at a point
//! near its city, a one-way delay between two of them of their access links plus the fibre
//! between their points (great-circle distance, inflated as routes are, at the speed of light
//! in glass). Homes sit behind consumer access links, datacentres behind short ones.

use std::time::Duration;

use crate::sim::SimRng;

/// A city a region is centred on: its name, latitude and longitude (degrees), and its share
/// of the world's nodes.
#[derive(Debug, Clone, Copy)]
pub struct City {
    /// Its name.
    pub name: &'static str,
    /// Latitude, degrees.
    pub lat: f64,
    /// Longitude, degrees.
    pub lon: f64,
    /// Share of the nodes.
    pub share: f64,
}

/// Six regions of the internet and the shares of nodes in them.
pub const CITIES: [City; 6] = [
    City {
        name: "Frankfurt",
        lat: 50.1,
        lon: 8.7,
        share: 0.25,
    },
    City {
        name: "Virginia",
        lat: 38.9,
        lon: -77.4,
        share: 0.25,
    },
    City {
        name: "California",
        lat: 37.4,
        lon: -122.0,
        share: 0.15,
    },
    City {
        name: "São Paulo",
        lat: -23.5,
        lon: -46.6,
        share: 0.10,
    },
    City {
        name: "Singapore",
        lat: 1.35,
        lon: 103.8,
        share: 0.10,
    },
    City {
        name: "Tokyo",
        lat: 35.7,
        lon: 139.7,
        share: 0.15,
    },
];

/// Where a node is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Place {
    /// Its region ([`CITIES`]).
    pub region: usize,
    /// Latitude and longitude, degrees.
    pub at: (f64, f64),
    /// Its access link's one-way delay.
    pub access: Duration,
}

/// How the world's delays are drawn.
#[derive(Debug, Clone, Copy)]
pub struct World {
    /// How far a node may be from its city, degrees of latitude and longitude each way.
    pub spread_deg: f64,
    /// Share of nodes at home (the rest in datacentres).
    pub homes: f64,
    /// A home's access link one way, drawn from this range.
    pub home_access: (Duration, Duration),
    /// A datacentre's, drawn from this range.
    pub datacentre_access: (Duration, Duration),
    /// How much longer fibre routes are than the great circle.
    pub inflation: f64,
}

impl Default for World {
    fn default() -> Self {
        Self {
            spread_deg: 3.0,
            homes: 0.7,
            home_access: (Duration::from_millis(4), Duration::from_millis(12)),
            datacentre_access: (Duration::from_micros(200), Duration::from_micros(600)),
            inflation: 1.5,
        }
    }
}

/// Kilometres light goes in glass in a millisecond.
const FIBRE_KM_PER_MS: f64 = 200.0;

/// Earth's mean radius, kilometres.
const EARTH_KM: f64 = 6371.0;

impl World {
    /// A node drawn at random: its region by the cities' shares, a point near its city, home or
    /// datacentre.
    pub fn place(&self, rng: &mut SimRng) -> Place {
        let mut u = rng.unit();
        let mut region = CITIES.len() - 1;
        for (i, c) in CITIES.iter().enumerate() {
            if u < c.share {
                region = i;
                break;
            }
            u -= c.share;
        }
        self.place_in(region, !rng.chance(self.homes), rng)
    }

    /// A node in `region`, in a datacentre or at home.
    pub fn place_in(&self, region: usize, datacentre: bool, rng: &mut SimRng) -> Place {
        let c = CITIES[region];
        let off = |rng: &mut SimRng| (rng.unit() * 2.0 - 1.0) * self.spread_deg;
        let at = (c.lat + off(rng), c.lon + off(rng));
        let (lo, hi) = match datacentre {
            true => self.datacentre_access,
            false => self.home_access,
        };
        Place {
            region,
            at,
            access: rng.duration(lo, hi),
        }
    }

    /// The one-way delay between two nodes.
    pub fn one_way(&self, a: &Place, b: &Place) -> Duration {
        let km = great_circle_km(a.at, b.at) * self.inflation;
        a.access + b.access + Duration::from_secs_f64(km / FIBRE_KM_PER_MS / 1000.0)
    }
}

/// Great-circle distance between two points, kilometres (haversine).
pub fn great_circle_km(a: (f64, f64), b: (f64, f64)) -> f64 {
    let (la1, lo1, la2, lo2) = (
        a.0.to_radians(),
        a.1.to_radians(),
        b.0.to_radians(),
        b.1.to_radians(),
    );
    let h = ((la2 - la1) / 2.0).sin().powi(2)
        + la1.cos() * la2.cos() * ((lo2 - lo1) / 2.0).sin().powi(2);
    2.0 * EARTH_KM * h.sqrt().min(1.0).asin()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_those_of_the_map() {
        // Frankfurt to Virginia is about 6,500 km: ~49 ms one way at 1.5 × the great circle.
        let km = great_circle_km((50.1, 8.7), (38.9, -77.4));
        assert!((6300.0..6700.0).contains(&km), "{km} km");
        let w = World::default();
        let dc = |region| Place {
            region,
            at: (CITIES[region].lat, CITIES[region].lon),
            access: Duration::ZERO,
        };
        let ms = w.one_way(&dc(0), &dc(1)).as_secs_f64() * 1000.0;
        assert!((47.0..51.0).contains(&ms), "{ms} ms");
        assert_eq!(w.one_way(&dc(0), &dc(0)), Duration::ZERO);
        let mut rng = SimRng::new(3);
        let counts = (0..6000).fold([0usize; 6], |mut c, _| {
            c[w.place(&mut rng).region] += 1;
            c
        });
        for (c, city) in counts.iter().zip(CITIES) {
            let share = *c as f64 / 6000.0;
            assert!((share - city.share).abs() < 0.03, "{}: {share}", city.name);
        }
    }
}
